"""The endpoints of the REST service, one FastAPI router per resource: `health` (/healthz,
/readyz), `distillations` (the jobs and their results), `catalog` (datasets, teachers, presets).
What they share comes through dependencies (`common`): the service on `app.state.service` and
the bearer token check."""
