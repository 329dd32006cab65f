"""The jobs, above `planning/`: each run by a driver process of its own on Ray. From the bottom:
`private_files` (owner-only atomic writes), `job_files` (a job's folder and the files its driver
and the service hand each other), `soft_label_packing`, `local_ray` (the service's Ray head) and
`head_lifeline` (the process that stops it once nothing needs it), `job_records` (SQLite),
`job_outputs` (what a job gives back), `leftovers`, `retention`, `runner` (the driver: `python -m
api.jobs.runner JOB_DIR`) and `drivers` (the supervisor that starts and watches them)."""
