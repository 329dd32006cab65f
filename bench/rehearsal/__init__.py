"""Rehearsals: what a user does, done here at scale or across processes.

    python -m bench.rehearsal.imagenet        an ImageNet-1K run with the `fadrm` command at 10, 100
                                              and 1000 classes (docs/benchmarks/imagenet-scale.md);
                                              `measure` and `report` are its gauges and tables
    python -m bench.rehearsal.submit_repeat   `ray job submit` of one small sweep N times on a 2-node
                                              cluster on 127.0.0.1 (docs/benchmarks/sweeps.md)

`deploy` runs deploy/README.md's commands against such a cluster (tests/test_deploy*.py).
"""
