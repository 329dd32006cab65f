"""A distillation run: the job, its plan, its execution and the messages its processes exchange.

- `job`: `DistillJob`, everything one run needs, built once by whichever door asked for it, with
  its run id (`make_run_id`); `ExecutionSpec`, how it runs; `JobParts`, what building it loaded.
- `units`: how a run is cut into units (a class shard times a range of IPC indices) around the
  units it already has.
- `stages`: one unit's recover stages, from its patches to its store records (the same functions
  in this process, on a Ray actor or in a Tune trial).
- `execute`: the door `run(job, spec, parts)` in this process (`actors.coordinator.run` is the
  Ray one, with the same signature); `run_job` (the lock, the plan, the manifest) through any
  `RunExecutor`; the local one.
- `messages`: the typed replies and records that cross a process or a file on the way back.
- `reopen`: a run's data and teachers found again from what its provenance records, each checked
  (for an evaluation or a repair).

Imports point one way: `execute` -> `stages`, `units` -> `job`.
"""
