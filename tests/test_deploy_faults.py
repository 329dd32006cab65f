"""Faults put into a copy of deploy/, one at a time and seven of them at once: each must be
reported by the check named with it (tests/test_deploy_checks.py), for the reason named with it.
An unbroken copy passes every check, so what is caught is the fault, not the copy.

Each fault is a text edit that must apply exactly where it says (the edit's old text is looked
for, and its absence fails the test), so a fault cannot silently stop being injected when the
files change.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.test_deploy_checks import (CHECKS, DEPLOY, dockerfile_problems, ray_cli_problems, rayjob_problems,
                                      registry_problems, schema_problems, shm_problems, storage_problems,
                                      supervision_problems, token_problems, volume_problems, wiring_problems)

ALIVE = ("                  r.urlopen('http://127.0.0.1:52365/api/local_raylet_healthz', timeout=3);\n"
         "                  r.urlopen('http://127.0.0.1:8000/healthz', timeout=3)\n")
SWEEP_WORKER_VOLUMES = ("                  - {name: shared, mountPath: /shared}\n"
                        "            volumes:\n"
                        "              - name: shared\n"
                        "                persistentVolumeClaim: {claimName: fadrm-shared}\n"
                        "            tolerations:")
SWEEP_WORKER_DSHM = ("                  - {name: shared, mountPath: /shared}\n"
                     "                  - {name: dshm, mountPath: /dev/shm}\n"
                     "            volumes:\n"
                     "              - name: shared\n"
                     "                persistentVolumeClaim: {claimName: fadrm-shared}\n"
                     "              - name: dshm\n"
                     "                emptyDir: {medium: Memory, sizeLimit: 8Gi}\n"
                     "            tolerations:")

# name: (file, old text, new text, the check that must catch it, what its report must say)
FIRST_FAULTS = {
    "misspelt mountPath": ("k8s/raycluster.yaml", "{name: shared, mountPath: /shared}",
                           "{name: shared, mountPth: /shared}", schema_problems, "mountPth"),
    "unknown autoscalerOptions field": ("k8s/raycluster.yaml", "    idleTimeoutSeconds: 600\n",
                                        "    idleTimeoutSeconds: 600\n    scaleDownDelay: 60\n", schema_problems,
                                        "scaleDownDelay"),
    "backoffLimit: none": ("k8s/rayjob-sweep.yaml", "backoffLimit: 0", "backoffLimit: none", schema_problems,
                           "spec.backoffLimit: 'none' is not of type 'integer'"),
    "RUN pip instal": ("Dockerfile", "RUN pip install", "RUN pip instal", dockerfile_problems,
                       "pip has no such command"),
    "ray start --adress=": ("vm/cluster-gpu.yaml", "ray start --address=$RAY_HEAD_IP", "ray start --adress=$RAY_HEAD_IP",
                            ray_cli_problems, "No such option '--adress'"),
    "initialDelaySeconds: twenty": ("k8s/api.yaml", "            periodSeconds: 20\n",
                                    "            initialDelaySeconds: twenty\n            periodSeconds: 20\n",
                                    schema_problems, "initialDelaySeconds: 'twenty' is not of type"),
    "--volume off the EFS mount": ("vm/cluster-gpu.yaml", "--volume /mnt/efs:/shared", "--volume /mnt/efs-data:/shared",
                                   volume_problems, "`--volume /mnt/efs-data:/shared`, but initialization_commands mount"),
}
MORE_FAULTS = {
    "ray job submit misspelt option": ("README.md", "--working-dir . -- \\\n  python -m actors.job distill",
                                       "--working-directory . -- \\\n  python -m actors.job distill", ray_cli_problems,
                                       "--working-directory"),
    "rayStartParams unknown to ray start": ("k8s/raycluster.yaml", 'num-cpus: "0"', 'num-cpu: "0"', ray_cli_problems,
                                            "--num-cpu"),
    "rayStartParams value not a string": ("k8s/rayjob-distill.yaml", 'num-gpus: "0"', "num-gpus: 0", schema_problems,
                                          "rayStartParams.num-gpus: 0 is not of type 'string'"),
    "worker group maxReplicas a string": ("k8s/rayjob-sweep.yaml", "maxReplicas: 4", 'maxReplicas: "4"',
                                          schema_problems, "maxReplicas: '4' is not of type 'integer'"),
    "memory limit not a quantity": ("k8s/raycluster-env-auth.yaml", "limits: {cpu: \"4\", memory: 16Gi}",
                                    "limits: {cpu: \"4\", memory: 16GB}", schema_problems, "'16GB' is not a quantity"),
    "COPY of a missing folder": ("Dockerfile", "COPY --chown=ray:users tune ./tune", "COPY --chown=ray:users tunes ./tunes",
                                 dockerfile_problems, "source tunes is not in the build context"),
    "pip requirement with one =": ("Dockerfile", "torch==${TORCH_VERSION} torchvision",
                                   "torch=${TORCH_VERSION} torchvision", dockerfile_problems, "is not a requirement"),
    "stage ARG not declared again": ("Dockerfile", "ARG TORCH_CPU_INDEX\n", "", dockerfile_problems,
                                     "$TORCH_CPU_INDEX is not declared in this stage"),
    "misspelt instruction": ("Dockerfile", "WORKDIR /home", "WORKDR /home", dockerfile_problems,
                             "WORKDR is not a Dockerfile instruction"),
    "Service targetPort of no port": ("k8s/api.yaml", "targetPort: http", "targetPort: htp", wiring_problems,
                                      "targetPort 'htp'"),
    "API pointed at the GCS port + 1": ("k8s/api.yaml", '"fadrm-head-svc:6379"', '"fadrm-head-svc:6380"',
                                        wiring_problems, "FADRM_RAY_ADDRESS 'fadrm-head-svc:6380'"),
    "probe on a port serve does not use": ("k8s/api.yaml", "127.0.0.1:8000/readyz", "127.0.0.1:8001/readyz",
                                           wiring_problems, "asks /readyz on port 8001"),
    "mount of an undefined volume": ("k8s/raycluster-env-auth.yaml", "{name: shared, mountPath: /shared}",
                                     "{name: shard, mountPath: /shared}", volume_problems, "mounts volume 'shard'"),
    "local cluster volume off its mount": ("vm/cluster-local.yaml", "--volume /mnt/shared:/shared",
                                           "--volume /mnt/nfs:/shared", volume_problems, "never tell where"),
    "RayJob output off the head's mounts": ("k8s/rayjob-sweep.yaml", "--out /shared/sweeps", "--out /data/sweeps",
                                            volume_problems, "the entrypoint uses /data/"),
    "8Gi /dev/shm back on the workers": ("k8s/rayjob-sweep.yaml", SWEEP_WORKER_VOLUMES, SWEEP_WORKER_DSHM, shm_problems,
                                         "/dev/shm of 8.0 GiB, replacing the one KubeRay sizes"),
    "API /dev/shm of 64 MiB": ("k8s/api.yaml", "sizeLimit: 2560Mi", "sizeLimit: 64Mi", shm_problems,
                               "smaller than Ray's object store"),
    "API Ray without --block": ("k8s/api.yaml", "--disable-usage-stats --block &", "--disable-usage-stats &",
                                supervision_problems, "without --block"),
    "API Ray not watched": ("k8s/api.yaml", '  wait -n "$ray_pid" "$serve_pid"\n', '  wait "$serve_pid"\n',
                            supervision_problems, "no `wait -n`"),
    "API liveness ignoring Ray": ("k8s/api.yaml", ALIVE,
                                  "                  r.urlopen('http://127.0.0.1:8000/healthz', timeout=3)\n",
                                  supervision_problems, "livenessProbe does not ask the raylet"),
    "no ECR login": ("vm/cluster-gpu.yaml", "  - aws ecr get-login-password --region us-west-2 | docker login "
                     "--username AWS --password-stdin ACCOUNT.dkr.ecr.us-west-2.amazonaws.com\n", "",
                     registry_problems, "no initialization command logs Docker in"),
    "ECR login to another region": ("vm/cluster-gpu.yaml", "get-login-password --region us-west-2",
                                    "get-login-password --region us-east-1", registry_problems, "the ECR login is not"),
    "workers without an instance profile": ("vm/cluster-gpu.yaml", '      IamInstanceProfile: {Arn: "arn:aws:iam::ACCOUNT:'
                                            'instance-profile/fadrm-ray-worker"}  # ECR pulls\n', "", registry_problems,
                                            "node type gpu has no IamInstanceProfile"),
    "storage class left unset": ("k8s/storage.yaml", "  storageClassName: RWX_STORAGE_CLASS\n", "", storage_problems,
                                 "storageClassName unset"),
    "storage applied with its placeholder": ("README.md", 'sed "s#RWX_STORAGE_CLASS#$STORAGE_CLASS#" '
                                             "deploy/k8s/storage.yaml | kubectl apply -f -",
                                             "kubectl apply -f deploy/k8s/storage.yaml", storage_problems,
                                             "never substitutes it"),
    "re-apply said to resume": ("k8s/rayjob-sweep.yaml",
                                "#   kubectl delete rayjob fadrm-sweep && kubectl apply -f deploy/k8s/rayjob-sweep.yaml\n",
                                "# Applying the same file again resumes the sweep.\n", rayjob_problems,
                                "a second apply of a RayJob does nothing"),
    "a 64-bit API token": ("README.md", "secrets.token_urlsafe(32), end=''", "secrets.token_urlsafe(8), end=''",
                           token_problems, "makes 64 bits"),
    "an API token file ending in a newline": ("README.md", "print(secrets.token_urlsafe(32), end='')",
                                              "print(secrets.token_urlsafe(32))", token_problems, "printable ASCII"),
}
FAULTS = {**FIRST_FAULTS, **MORE_FAULTS}


def inject(folder: Path, file: str, old: str, new: str) -> None:
    path = folder / file
    text = path.read_text()
    assert old in text, f"fault no longer applies: {old!r} is not in deploy/{file}"
    path.write_text(text.replace(old, new, 1))


@pytest.fixture
def deploy_copy(tmp_path):
    folder = tmp_path / "deploy"
    shutil.copytree(DEPLOY, folder)
    return folder


def run_checks(folder: Path) -> dict[str, list[str]]:
    return {check.__name__: check(folder) for check in CHECKS}


def test_an_unbroken_copy_passes_every_check(deploy_copy):
    assert run_checks(deploy_copy) == {check.__name__: [] for check in CHECKS}


@pytest.mark.parametrize("name", FAULTS)
def test_each_fault_alone_is_caught(deploy_copy, name):
    file, old, new, check, says = FAULTS[name]
    inject(deploy_copy, file, old, new)
    found = run_checks(deploy_copy)  # every check runs on it: none may crash on a broken file
    assert any(says in p for p in found[check.__name__]), (name, found)


def test_seven_faults_at_once_are_all_caught(deploy_copy):
    for file, old, new, _, _ in FIRST_FAULTS.values():
        inject(deploy_copy, file, old, new)
    found = run_checks(deploy_copy)
    missed = [name for name, (_, _, _, check, says) in FIRST_FAULTS.items()
              if not any(says in p for p in found[check.__name__])]
    assert missed == [], found
