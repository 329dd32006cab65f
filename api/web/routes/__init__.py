"""The endpoints of the REST service, one FastAPI router per resource: `health` (/healthz,
/readyz), `distillations` (the jobs and their results), `offered` (what a request may name: the
datasets, teachers and presets). What they share comes through `dependencies`: the service on
`app.state.service` and the bearer token check."""
