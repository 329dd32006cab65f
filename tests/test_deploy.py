"""Every file of deploy/ checked offline: the VM configs against Ray's own cluster-config schema,
the Kubernetes manifests against the fields of their kinds and against each other, the versions
against pyproject.toml, every module a manifest or the runtime env names, and the runtime env
against Ray's parser. No cluster, no network, no Docker.

The README's blocks are read by bench/rehearsal/deploy.py, which the rehearsal
(tests/test_deploy_rehearsal.py) shares.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from bench.rehearsal.deploy import DEPLOY, REPO, after_double_dash, readme_blocks, readme_command

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

VM_CONFIGS = sorted((DEPLOY / "vm").glob("*.yaml"))
K8S_FILES = sorted((DEPLOY / "k8s").glob("*.yaml"))
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())



# --------------------------------------------------------------------------- shared helpers
def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def manifests() -> list[tuple[Path, dict]]:
    return [(path, doc) for path in K8S_FILES for doc in load_docs(path)]


def module_args(words: list[str], module: str) -> list[str]:
    """The arguments after `python -m MODULE` in a command."""
    for i in range(len(words) - 2):
        if words[i] in ("python", "python3") and words[i + 1] == "-m" and words[i + 2] == module:
            return words[i + 3:]
    raise AssertionError(f"no `python -m {module}` in {words}")


def dockerfile_args() -> dict[str, str]:
    text = (DEPLOY / "Dockerfile").read_text()
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.M))


def ray_version() -> str:
    return dockerfile_args()["RAY_VERSION"]


def pyproject_requirement(name: str):
    from packaging.requirements import Requirement

    for dep in PYPROJECT["project"]["dependencies"]:
        req = Requirement(dep)
        if req.name == name:
            return req
    raise AssertionError(f"{name} not in pyproject.toml")


def command_args(module: str, argv: list[str]) -> argparse.Namespace:
    """`argv` parsed as the `fadrm` subcommand that entry point module `module` (tune.sweep_command,
    api.serve_command) registers, by the real `fadrm` parser (common flags included)."""
    from fadrm_ray.cli import build_parser

    command = importlib.import_module(module)
    return build_parser(commands=[command]).parse_args([command.NAME, *argv])


def ray_cluster_specs() -> list[tuple[str, dict]]:
    """Every RayCluster spec in deploy/k8s: the standalone ones and those inside RayJobs."""
    specs = []
    for path, doc in manifests():
        if doc["kind"] == "RayCluster":
            specs.append((f"{path.name}:{doc['metadata']['name']}", doc["spec"]))
        elif doc["kind"] == "RayJob":
            specs.append((f"{path.name}:{doc['metadata']['name']}", doc["spec"]["rayClusterSpec"]))
    return specs


def pod_specs(cluster_spec: dict) -> list[tuple[str, dict]]:
    pods = [("head", cluster_spec["headGroupSpec"]["template"]["spec"])]
    pods += [(g["groupName"], g["template"]["spec"]) for g in cluster_spec["workerGroupSpecs"]]
    return pods


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


# --------------------------------------------------------------------------- VM configs
@pytest.mark.parametrize("path", VM_CONFIGS, ids=lambda p: p.name)
def test_vm_config_is_valid_for_rays_cluster_launcher(path):
    import copy

    import jsonschema
    import ray
    from ray.autoscaler._private.util import prepare_config, validate_config

    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    config = yaml.safe_load(path.read_text())
    jsonschema.validate(config, schema)
    validate_config(prepare_config(copy.deepcopy(config)))  # the launcher's own checks, defaults filled in


@pytest.mark.parametrize("path", VM_CONFIGS, ids=lambda p: p.name)
def test_vm_config_runs_the_image_with_token_auth_and_shared_storage(path):
    config = yaml.safe_load(path.read_text())
    docker = config["docker"]
    assert docker["image"].endswith(f"fadrm-ray:{PYPROJECT['project']['version']}-cuda")
    assert "--env RAY_AUTH_MODE=token" in docker["run_options"]
    assert any(o.startswith("--volume ") and o.endswith(":/shared") for o in docker["run_options"])
    assert config["file_mounts"]["/home/ray/.ray/auth_token"] == "~/.ray/auth_token"
    starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    ray_starts = [c for c in starts if "ray start" in c]
    assert len(ray_starts) == 2 and all(c.startswith("RAY_AUTH_MODE=token ray start ") for c in ray_starts)
    head = next(c for c in ray_starts if "--head" in c)
    assert "--num-cpus=0" in head and "--num-gpus=0" in head, "the head must take no distillation work"


def test_aws_config_has_an_autoscaling_gpu_worker_type_and_an_idle_head():
    config = yaml.safe_load((DEPLOY / "vm" / "cluster-gpu.yaml").read_text())
    assert config["provider"]["type"] == "aws"
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"] == {"CPU": 0, "GPU": 0}
    workers = [t for name, t in types.items() if name != config["head_node_type"]]
    gpu = [t for t in workers if t["resources"].get("GPU", 0) >= 1]
    assert gpu and all(t["max_workers"] > t.get("min_workers", 0) for t in gpu)
    assert config["max_workers"] >= max(t["max_workers"] for t in gpu)
    assert any("EFS_ID" in c and "/mnt/efs" in c for c in config["initialization_commands"])


# --------------------------------------------------------------------------- Kubernetes
# The fields each kind must have, as paths into the manifest (checked present and non-empty).
REQUIRED = {
    "RayCluster": ["spec.rayVersion", "spec.headGroupSpec.rayStartParams", "spec.headGroupSpec.template.spec.containers",
                   "spec.workerGroupSpecs"],
    "RayJob": ["spec.entrypoint", "spec.shutdownAfterJobFinishes", "spec.activeDeadlineSeconds",
               "spec.rayClusterSpec.rayVersion", "spec.rayClusterSpec.headGroupSpec.template.spec.containers",
               "spec.rayClusterSpec.workerGroupSpecs"],
    "Deployment": ["spec.replicas", "spec.selector.matchLabels", "spec.template.metadata.labels",
                   "spec.template.spec.containers"],
    "Service": ["spec.selector", "spec.ports"],
    "PersistentVolumeClaim": ["spec.accessModes", "spec.resources.requests.storage"],
}
API_VERSIONS = {"RayCluster": "ray.io/v1", "RayJob": "ray.io/v1", "Deployment": "apps/v1", "Service": "v1",
                "PersistentVolumeClaim": "v1"}


def field(doc: dict, dotted: str):
    value = doc
    for key in dotted.split("."):
        assert isinstance(value, dict) and key in value, f"missing {dotted}"
        value = value[key]
    return value


@pytest.mark.parametrize("path,doc", manifests(), ids=lambda v: v.name if isinstance(v, Path) else v["kind"])
def test_k8s_manifest_has_the_fields_of_its_kind(path, doc):
    assert doc["kind"] in REQUIRED, f"{path.name}: no checks for kind {doc['kind']}"
    assert doc["apiVersion"] == API_VERSIONS[doc["kind"]]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
    for dotted in REQUIRED[doc["kind"]]:
        value = field(doc, dotted)
        assert value not in (None, "", []), f"{path.name}: {dotted} is empty"
    pods = []
    if doc["kind"] in ("RayCluster", "RayJob"):
        spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
        pods = [p for _, p in pod_specs(spec)]
        for group in spec["workerGroupSpecs"]:
            assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
            assert all(isinstance(v, str) for v in group["rayStartParams"].values())
        assert all(isinstance(v, str) for v in spec["headGroupSpec"]["rayStartParams"].values())
    elif doc["kind"] == "Deployment":
        pods = [doc["spec"]["template"]["spec"]]
    for pod in pods:
        for container in pod["containers"]:
            assert container["name"] and container["image"]
            assert container["resources"]["limits"], f"{path.name}: {container['name']} has no limits"
            mounts = {m["name"] for m in container.get("volumeMounts", [])}
            assert mounts <= {v["name"] for v in pod.get("volumes", [])}


@pytest.mark.parametrize("name,spec", ray_cluster_specs(), ids=lambda v: v if isinstance(v, str) else "")
def test_ray_clusters_have_token_auth_a_gpu_group_an_idle_head_and_the_shared_volume(name, spec):
    assert spec["rayVersion"] == ray_version()
    auth = spec.get("authOptions")
    for group, pod in pod_specs(spec):
        for container in pod["containers"]:
            env = env_of(container)
            if auth is None:  # the Secret-based env of operators before v1.6.0
                assert env["RAY_AUTH_MODE"]["value"] == "token", f"{name} {group}"
                assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "fadrm-ray-token", "key": "auth_token"}
            else:
                assert "RAY_AUTH_TOKEN" not in env and "RAY_AUTH_MODE" not in env, "the operator sets them"
            assert {"name": "shared", "mountPath": "/shared"} in container["volumeMounts"]
        assert {"name": "shared", "persistentVolumeClaim": {"claimName": "fadrm-shared"}} in pod["volumes"]
    if auth is not None:
        assert auth == {"mode": "token", "secretName": "fadrm-ray-token"}
    head = spec["headGroupSpec"]["rayStartParams"]
    assert head["num-cpus"] == "0" and head["num-gpus"] == "0", "the head must take no distillation work"
    gpu_groups = [g for g in spec["workerGroupSpecs"]
                  if all("nvidia.com/gpu" in c["resources"]["limits"] for c in g["template"]["spec"]["containers"])]
    assert gpu_groups, f"{name}: no GPU worker group"
    for group in gpu_groups:
        for c in group["template"]["spec"]["containers"]:
            assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
            assert c["image"] == f"fadrm-ray:{PYPROJECT['project']['version']}-cuda"


def test_the_long_running_cluster_autoscales_its_gpu_workers():
    for path in (DEPLOY / "k8s" / "raycluster.yaml", DEPLOY / "k8s" / "raycluster-env-auth.yaml"):
        spec = load_docs(path)[0]["spec"]
        assert spec["enableInTreeAutoscaling"] is True
        assert spec["workerGroupSpecs"][0]["minReplicas"] == 0 and spec["workerGroupSpecs"][0]["maxReplicas"] > 1
    # the two variants are one cluster, differing only in how the token gets in
    a, b = (load_docs(DEPLOY / "k8s" / f)[0] for f in ("raycluster.yaml", "raycluster-env-auth.yaml"))
    a["spec"].pop("authOptions")
    for spec in (b["spec"],):
        for _, pod in pod_specs(spec):
            for c in pod["containers"]:
                c["env"] = [e for e in c["env"] if not e["name"].startswith("RAY_AUTH")]
    assert a == b


def rayjob(name: str) -> dict:
    return load_docs(DEPLOY / "k8s" / f"rayjob-{name}.yaml")[0]


@pytest.mark.parametrize("name,module", [("distill", "actors.job"), ("sweep", "tune.sweep")])
def test_rayjobs_shut_down_are_bounded_and_carry_the_runtime_env(name, module):
    job = rayjob(name)["spec"]
    assert job["shutdownAfterJobFinishes"] is True
    assert isinstance(job["activeDeadlineSeconds"], int) and job["activeDeadlineSeconds"] > 0
    assert job["ttlSecondsAfterFinished"] > 0
    words = shlex.split(job["entrypoint"])
    assert words[:3] == ["python", "-m", module]
    runtime_env = yaml.safe_load((DEPLOY / "runtime_env.yaml").read_text())
    assert yaml.safe_load(job["runtimeEnvYAML"]) == {"env_vars": runtime_env["env_vars"]}


def test_rayjob_distill_entrypoint_is_a_valid_distill_command():
    from fadrm_ray.cli import build_parser

    args = build_parser().parse_args(module_args(shlex.split(rayjob("distill")["spec"]["entrypoint"]), "actors.job"))
    assert args.command == "distill" and args.out.startswith("/shared/") and args.teacher[0].startswith("/shared/")
    assert args.gpus_per_worker and args.json


def test_rayjob_sweep_entrypoint_is_a_valid_sweep_command():
    args = command_args("tune.sweep_command", module_args(shlex.split(rayjob("sweep")["spec"]["entrypoint"]), "tune.sweep"))
    assert args.out.startswith("/shared/")


def api_script_commands(container: dict) -> list[list[str]]:
    """The simple commands of the API container's bash script, as words."""
    from tests.test_deploy_checks import shell_commands as script_commands

    assert container["command"] == ["bash", "-c"] and len(container["args"]) == 1
    return [words for words, _ in script_commands(container["args"][0])]


def api_serve_command(container: dict) -> list[str]:
    """The `fadrm serve ...` words the API container runs (beside its Ray node)."""
    serves = [w for w in api_script_commands(container) if w[:2] == ["fadrm", "serve"]]
    assert len(serves) == 1, serves
    return serves[0]


def test_api_deployment_talks_to_the_cluster_head_with_tokens_from_secrets():
    docs = {d["kind"]: d for d in load_docs(DEPLOY / "k8s" / "api.yaml")}
    deployment, service = docs["Deployment"], docs["Service"]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    pod = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    container = pod["spec"]["containers"][0]
    assert container["image"] == f"fadrm-ray:{PYPROJECT['project']['version']}-cpu"
    serve = api_serve_command(container)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert service["spec"]["ports"][0]["targetPort"] in ports
    assert ports["http"] == int(serve[serve.index("--port") + 1])
    # it joins the cluster as a node that takes no work, and serves beside it
    joins = [w for w in api_script_commands(container) if w[:2] == ["ray", "start"]]
    assert len(joins) == 1
    join = joins[0]
    assert "--address=$FADRM_RAY_ADDRESS" in join and "--block" in join
    assert "--num-cpus=0" in join and "--num-gpus=0" in join
    env = env_of(container)
    assert env["FADRM_API_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "fadrm-api-token", "key": "token"}
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "fadrm-ray-token", "key": "auth_token"}
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    documented = {"FADRM_API_TOKEN", "FADRM_STORE", "FADRM_TEACHERS", "FADRM_DATASETS", "FADRM_RAY_ADDRESS",
                  "FADRM_MAX_RUNNING", "FADRM_MAX_QUEUED", "FADRM_MAX_IPC", "FADRM_MAX_IMAGES", "FADRM_DATA"}
    assert {k for k in env if k.startswith("FADRM_")} <= documented
    assert env["FADRM_STORE"]["value"].startswith("/shared/") and env["FADRM_TEACHERS"]["value"].startswith("/shared/")
    # the head Service KubeRay makes for the RayCluster, on the head's Ray Client port
    cluster = load_docs(DEPLOY / "k8s" / "raycluster.yaml")[0]
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    gcs_port = {p["name"]: p["containerPort"] for p in head["ports"]}["gcs-server"]
    assert env["FADRM_RAY_ADDRESS"]["value"] == f"{cluster['metadata']['name']}-head-svc:{gcs_port}"
    # readiness on /readyz (with the bearer token, from the env), liveness on /healthz (no auth),
    # both on the raylet's health too (tests/test_deploy_checks.py runs them against stubs)
    probe = container["readinessProbe"]["exec"]["command"]
    assert probe[:2] == ["python", "-c"] and "/readyz" in probe[2] and "FADRM_API_TOKEN" in probe[2]
    compile(probe[2], "readinessProbe", "exec")
    alive = container["livenessProbe"]["exec"]["command"]
    assert alive == container["startupProbe"]["exec"]["command"]
    assert "/healthz" in alive[2] and "/api/local_raylet_healthz" in alive[2] and "FADRM_API_TOKEN" not in alive[2]


def test_api_command_is_a_valid_serve_command():
    container = load_docs(DEPLOY / "k8s" / "api.yaml")[0]["spec"]["template"]["spec"]["containers"][0]
    args = command_args("api.serve_command", api_serve_command(container)[2:])
    assert args.host == "0.0.0.0" and int(args.port) == 8000


def test_one_shared_volume_for_every_pod():
    pvcs = [d for _, d in manifests() if d["kind"] == "PersistentVolumeClaim"]
    assert len(pvcs) == 1 and pvcs[0]["spec"]["accessModes"] == ["ReadWriteMany"]
    claims = set(re.findall(r"claimName:\s*([\w-]+)", "".join(p.read_text() for p in K8S_FILES)))
    assert claims == {pvcs[0]["metadata"]["name"]}


# --------------------------------------------------------------------------- versions
def test_every_version_agrees_with_pyproject():
    from packaging.specifiers import SpecifierSet

    args = dockerfile_args()
    version = args["RAY_VERSION"]
    assert pyproject_requirement("ray").specifier.contains(version)
    assert {"default", "tune"} <= pyproject_requirement("ray").extras
    assert args["PYTHON_TAG"] == "py311" and SpecifierSet(PYPROJECT["project"]["requires-python"]).contains("3.11")
    assert pyproject_requirement("torch").specifier.contains(args["TORCH_VERSION"])
    assert pyproject_requirement("torchvision").specifier.contains(args["TORCHVISION_VERSION"])
    assert args["TORCH_CUDA_INDEX"].rstrip("/").rsplit("/", 1)[1] == args["CUDA"], "image CUDA != torch's CUDA build"
    assert args["TORCH_CPU_INDEX"].rstrip("/").endswith("/cpu")
    text = (DEPLOY / "Dockerfile").read_text()
    froms = re.findall(r"^FROM (\S+) AS (\w+)$", text, flags=re.M)
    assert froms == [("rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}", "cpu"),
                     ("rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}-${CUDA}", "cuda")]
    assert text.count('"ray[default,tune]==${RAY_VERSION}"') == 2
    assert text.count("--index-url ${TORCH_CPU_INDEX}") == 1 and text.count("--index-url ${TORCH_CUDA_INDEX}") == 1
    # every Ray version, image tag and Python version named anywhere in deploy/
    everything = "\n".join(p.read_text() for p in DEPLOY.rglob("*") if p.is_file())
    assert "ray-ml" not in everything and not re.search(r"rayproject/ray:latest|fadrm-ray:latest", everything)
    assert set(re.findall(r"rayVersion:\s*\"?([\d.]+)", everything)) == {version}
    assert set(re.findall(r"rayproject/ray:(\d[\w.]*)-", everything)) == {version}
    assert set(re.findall(r"-(py3\d+)", everything)) == {"py311"}
    tags = set(re.findall(r"fadrm-ray:([\w.-]+)", everything))
    assert tags == {f"{PYPROJECT['project']['version']}-cpu", f"{PYPROJECT['project']['version']}-cuda"}
    readme = (DEPLOY / "README.md").read_text()
    assert f"rayproject/ray:{version}-py311-{args['CUDA']}" in readme and f"torch {args['TORCH_VERSION']}" in readme


def test_dockerignore_sends_only_what_the_image_installs():
    lines = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines[0] == "*"
    kept = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    packages = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert kept == packages | {"pyproject.toml", "README.md"}
    copied = set(re.findall(r"^COPY --chown=ray:users (\S+) \./\1$", (DEPLOY / "Dockerfile").read_text(), flags=re.M))
    assert copied == packages


# --------------------------------------------------------------------------- modules and runtime env
PROJECT_PACKAGES = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}


def named_modules() -> list[tuple[str, str]]:
    """Every `python -m MODULE` and `fadrm SUBCOMMAND` in deploy/ (manifests, configs, README,
    runtime env), as (module, where)."""
    found = {}
    for path in sorted(DEPLOY.rglob("*")):
        if not path.is_file():
            continue
        text = path.read_text()
        for module in re.findall(r"python3? -m ([\w.]+)", text):
            if module.split(".")[0] in PROJECT_PACKAGES:  # not `python -m pytest`
                found.setdefault(module, path.name)
        for sub in re.findall(r"\bfadrm,? (serve|tune)\b", text):
            found.setdefault({"serve": "api.serve_command", "tune": "tune.sweep_command"}[sub], path.name)
    return sorted(found.items())


def test_deploy_names_the_entry_points_it_should():
    modules = {m for m, _ in named_modules()}
    assert {"actors.job", "tune.sweep", "api.serve_command"} <= modules


@pytest.mark.parametrize("module,where", named_modules())
def test_every_module_named_in_deploy_imports(module, where):
    assert importlib.util.find_spec(module) is not None, f"{module} (named in {where}) is not importable"
    importlib.import_module(module)
    entry = {e.split(":")[0]: n for n, e in PYPROJECT["project"]["entry-points"]["fadrm.commands"].items()}
    if module.endswith(".cli") or module in entry:  # a `fadrm SUBCOMMAND`: registered under that name
        assert module in entry
        assert importlib.import_module(module).NAME == entry[module]


def test_runtime_env_is_accepted_by_ray(tmp_path):
    from ray._private.runtime_env.packaging import create_package
    from ray.dashboard.modules.dashboard_sdk import parse_runtime_env_args
    from ray.runtime_env import RuntimeEnv

    # exactly what `ray job submit --runtime-env deploy/runtime_env.yaml --working-dir .` builds
    env = parse_runtime_env_args(runtime_env=str(DEPLOY / "runtime_env.yaml"), working_dir=str(REPO))
    parsed = RuntimeEnv(**env)
    assert parsed["env_vars"]["FADRM_DATA"].startswith("/shared/")
    assert set(env) == {"working_dir", "excludes", "env_vars"}
    # the package it uploads holds the code and stays small
    package = tmp_path / "working_dir.zip"
    create_package(str(REPO), package, include_gitignore=True, excludes=env["excludes"])
    import zipfile

    names = zipfile.ZipFile(package).namelist()
    assert "actors/job.py" in names and "fadrm_ray/cli/__init__.py" in names and "pyproject.toml" in names
    assert not any(n.startswith((".git/", "tests/", "deploy/")) for n in names)
    assert package.stat().st_size < 5 * 2**20


# --------------------------------------------------------------------------- README
def test_readme_covers_every_file_and_step():
    readme = (DEPLOY / "README.md").read_text()
    for path in DEPLOY.rglob("*"):
        if path.is_file() and path.name != "README.md":
            assert str(path.relative_to(DEPLOY)) in readme, f"deploy/README.md does not mention {path}"
    for mentioned in set(re.findall(r"deploy/([\w./-]+\.(?:yaml|md)|Dockerfile)", readme)):
        assert (DEPLOY / mentioned).is_file(), f"deploy/README.md names deploy/{mentioned}, which does not exist"
    blocks = readme_blocks()
    assert set(blocks) == {"token", "ray-start", "distill", "sweep", "serve", "curl"}
    for step in ("docker build", "docker push", "ray up", "kubectl apply", "ray job submit", "fadrm serve", "curl"):
        assert step in readme
    head = next(c for c in blocks["ray-start"].splitlines() if "--head" in c)
    assert head.startswith("RAY_AUTH_MODE=token ray start --head") and "--num-cpus=0" in head


def test_readme_distill_command_is_a_valid_job_submission():
    from fadrm_ray.cli import build_parser

    words = readme_command("distill", "ray")
    assert words[:3] == ["ray", "job", "submit"]
    submit = words[:words.index("--")]
    assert submit[submit.index("--runtime-env") + 1] == "deploy/runtime_env.yaml"
    assert submit[submit.index("--working-dir") + 1] == "."
    assert submit[submit.index("--address") + 1] == "$RAY_ADDRESS"
    args = build_parser().parse_args(module_args(after_double_dash(words), "actors.job"))
    assert args.command == "distill" and args.json and args.out.startswith("/shared/")


def test_readme_sweep_command_is_a_valid_job_submission():
    words = readme_command("sweep", "ray")
    assert words[:3] == ["ray", "job", "submit"] and "deploy/runtime_env.yaml" in words
    args = command_args("tune.sweep_command", module_args(after_double_dash(words), "tune.sweep"))
    assert args.out.startswith("/shared/")
