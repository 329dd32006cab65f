"""The product benchmarks, by subject; each command prints what docs/benchmarks/ tabulates.

- students' accuracy: `accuracy` (every preset's top-1), `pilot_cost` (the pilot's cost),
  `soft_label_size` (stored soft labels against bytes and top-1)
- speed: `speed/` (its package docstring lists the commands), `decode` (an image folder's decoding)
- memory and reads at ImageNet scale: `student_memory`, `evaluate_reads`
- rehearsals: `rehearsal/` (an ImageNet-1K run with the `fadrm` command; the deploy README on a
  2-node cluster)
- sweeps: `sweep` (a sweep's shared work)
- a newcomer's run: `estimates` (what `fadrm distill` estimates against what it took),
  `install_paths.sh` (what each install path downloads)
- the REST service: `api_load` (latency under polling), `api_probes/` (a hostile client)
- faults: `faults`, with the injectors the tests share in `fault_inject`
- the GPU check: `gpu_check.sh` and its steps (`gpu_steps`), the wheels it carries
  (`gpu_wheels.sh`, `gpu_image`), its figures kept as measured (`record`)
"""
