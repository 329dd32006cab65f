"""A simulated 2-node Ray cluster that loses a node mid-run still completes the run."""
import threading

import pytest

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from actors import coordinator  # noqa: E402
from fadrm_ray.config import make_config  # noqa: E402
from fadrm_ray.runs.job import ExecutionSpec  # noqa: E402
from fadrm_ray.store import open_run  # noqa: E402
from tests.ray_helpers import distill, events, wait_for  # noqa: E402


def test_losing_a_node_mid_run_still_completes(digits_teacher, tmp_path):
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    node = cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cfg = make_config("fadrm", overrides={"ipc": 4, "iterations": 160, "precision": "fp32", "ipc_per_unit": 1})
        result = {}
        thread = threading.Thread(target=lambda: result.update(r=distill(
            coordinator, cfg, [digits_teacher[0]], tmp_path, ExecutionSpec(workers=2, progress=False))))
        thread.start()
        run_dir = wait_for(lambda: next(iter([d for d in tmp_path.iterdir() if d.is_dir()]), None))
        wait_for(lambda: len({e["pid"] for e in events(run_dir, "stage_done")}) == 2, timeout=180)
        cluster.remove_node(node)
        thread.join(timeout=400)
        assert not thread.is_alive() and "r" in result
        assert events(run_dir, "stage_failed"), "the lost node should have cost a stage"
        done = [e["unit"] for e in events(run_dir, "unit_done")]
        assert len(done) == len(set(done)) == 4
        _, labels, ipc = open_run(run_dir).read()
        assert sorted(zip(labels.tolist(), ipc.tolist())) == [(c, i) for c in range(10) for i in range(4)]
    finally:
        ray.shutdown()
        cluster.shutdown()
