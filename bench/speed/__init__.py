"""How fast recover and the students run (results: docs/benchmarks/speed.md).

The commands, one measurement each:

    python -m bench.speed.side_by_side      the published loop (imported from a checkout of it) and ours,
                                            each in its own process, on one device (bench/gpu_check.sh)
    python -m bench.speed.engine_vs_reference  the engine against a plain reference loop on small images,
                                            with the images' quality, --ladder and --table
    python -m bench.speed.imagenet          the engine alone at the ImageNet-1K setting, against pack and
                                            precision (bench/gpu_check.sh's precision paths)
    python -m bench.speed.students          seconds per student epoch on each device
    python -m bench.speed.versions          this checkout's recover step and student epoch against another's
    python -m bench.speed.scaling           `fadrm distill` as typed, across workers, outside recover
    python -m bench.speed.efficiency        every method at its published budget (the paper's Table 2)

The parts they share: `timing` (the clock, the memory gauges, the profiler), `workers` (a side of
a comparison in a process of its own), `contender` (the published loop and ours at the
ImageNet-1K script's setting: the side-by-side's worker, and the loop bench.speed.imagenet and
bench.speed.versions time), `reference_loop` and `sides` (the reference loop and the worker of
each side of bench.speed.engine_vs_reference).
"""
