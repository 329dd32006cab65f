"""The REST service of fadrm-ray (`fadrm serve`) and its Python client: the public face, each name
loaded on first use (`import api` imports neither FastAPI, torch nor Ray).

- `create_app(settings)`: the FastAPI application `fadrm serve` runs;
- `ServiceSettings`: its settings (FADRM_* variables, or a YAML file: `ServiceSettings.load`);
- `FadrmClient`: the Python client of a running service (it needs only httpx).

The service's floors, from the bottom; a module imports only from its own floor and those below:

- `contract/`: what the service says to a client: the REST bodies (`schemas`) and its errors, each
  told in one line (`service_errors`);
- `planning/`: what a request may ask and the plan it becomes: the settings (`service_settings`),
  the limits of one request (`limits`), the operator's datasets and teachers (`catalog`), the
  request checked and built into its job (`requests`);
- `jobs/`: the jobs run as driver processes: their files (`private_files`, `job_files`), records
  (`job_records`) and what they give back (`job_outputs`, `soft_label_packing`), what a job that
  did not succeed leaves (`leftovers`), how long finished ones stay (`retention`), the driver
  (`runner`), the local Ray head and its lifeline (`local_ray`, `head_lifeline`), and the
  supervisor that runs them (`drivers`);
- `web/`: HTTP: bodies, refusals, the rate limits and connection guards (`http`), proxies,
  downloads, the probes, what the endpoints share (`service`), the routers (`routes/`) and the
  app (`app`);
- on top, `serve_command` (`fadrm serve`); beside it all, `client`, which imports nothing of the
  service.
"""
from fadrm_ray.lazy import lazy_attributes

_EXPORTS = {
    "create_app": "api.web.app",
    "ServiceSettings": "api.planning.service_settings",
    "FadrmClient": "api.client",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS)
