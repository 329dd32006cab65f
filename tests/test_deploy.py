"""The cluster configs parse, and the job commands they run are accepted by the CLI."""
import shlex
from pathlib import Path

import yaml

from fadrm_ray.cli import build_parser

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def job_args(command: str) -> list[str]:
    words = shlex.split(command)
    start = words.index("actors.job") + 1
    return words[start:]


def test_rayjob_entrypoint_is_a_valid_distill_command():
    spec = yaml.safe_load((DEPLOY / "kuberay-rayjob.yaml").read_text())
    assert spec["kind"] == "RayJob"
    args = build_parser().parse_args(job_args(spec["spec"]["entrypoint"]))
    assert args.command == "distill" and args.gpus_per_worker == 0.5 and args.out.startswith("/shared")
    head_env = spec["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "RAY_AUTH_MODE", "value": "token"} in head_env


def test_cluster_launcher_example_is_a_valid_distill_command():
    text = (DEPLOY / "ray-cluster.yaml").read_text()
    config = yaml.safe_load(text)
    assert all("RAY_AUTH_MODE=token" in c for c in config["head_start_ray_commands"] + config["worker_start_ray_commands"])
    example = " ".join(line.lstrip("#").strip().rstrip("\\") for line in text.splitlines()[2:5])
    args = build_parser().parse_args(job_args(example))
    assert args.command == "distill" and args.ipc == 10
