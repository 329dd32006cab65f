"""`fadrm serve`: run the REST service under uvicorn (settings: api/planning/service_settings.py),
registered with the `fadrm` command through the `fadrm.commands` entry point (pyproject.toml): a
subcommand module of the shape of `fadrm_ray.cli`'s (NAME, HEAVY, add_parser(sub), run(args))."""
from __future__ import annotations

import argparse
import ipaddress
import json
import os

from fadrm_ray.errors import InputError

# What the service writes (job records, logs, the runs and files it serves) is for its own user
# and group, never for every account on the machine.
UMASK = 0o027


NAME = "serve"
HEAVY = False


def add_parser(sub) -> argparse.ArgumentParser:
    from fadrm_ray.cli.common import common_parser

    parser = sub.add_parser(NAME, parents=[common_parser()],
                            help="run the REST service (settings from FADRM_* environment variables or --config)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind; one that is not loopback needs TLS (--ssl-*) or --insecure")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM; uvicorn's)")
    parser.add_argument("--ssl-keyfile", default=None, help="the certificate's private key (PEM; uvicorn's)")
    parser.add_argument("--insecure", action="store_true",
                        help="serve plain HTTP on a non-loopback --host (e.g. behind a proxy that ends TLS)")
    parser.add_argument("--config", default=None, help="YAML file of the FADRM_* settings (the environment wins)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("--stop-ray", action="store_true",
                        help="stop the local Ray head this store's service started, then exit")
    return parser


def run(args: argparse.Namespace) -> None:
    from api.planning.service_settings import ServiceSettings

    os.umask(UMASK)  # before anything is written, by this process or the ones it starts
    if not 0 < args.port < 65536:
        raise InputError(f"--port must be in 1..65535, got {args.port}")
    if args.ssl_keyfile and not args.ssl_certfile:
        raise InputError("--ssl-keyfile needs --ssl-certfile")
    if not (args.stop_ray or args.ssl_certfile or args.insecure or _loopback(args.host)):
        raise InputError(f"--host {args.host} is not a loopback address: the bearer token would cross the network "
                         "in plain HTTP; give --ssl-certfile and --ssl-keyfile, or --insecure behind a proxy "
                         "that ends TLS")
    settings = ServiceSettings.load(args.config)  # a bad setting: SettingsError, an InputError
    if args.stop_ray:
        from api.jobs.local_ray import LocalRay

        stopped = LocalRay(settings.state_dir, settings.ray_cpus).stop()
        print(json.dumps({"stopped": stopped}) if args.json else ("stopped the local Ray head" if stopped
                                                                  else "no local Ray head was running"))
        return
    import uvicorn

    _system_arrow_pool()
    from api.web.app import create_app
    from api.web.http import guarded_protocol, uvicorn_log_config

    app = create_app(settings)  # refuses a second service on the same store before binding
    # X-Forwarded-For only from the proxies the operator names (FADRM_TRUSTED_PROXIES; none by
    # default), read by the app itself (api.web.proxies), never by uvicorn's own default.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=True,
                log_config=uvicorn_log_config(settings.log_file, settings.log_max_bytes, settings.log_backups),
                ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile, timeout_graceful_shutdown=10,
                http=guarded_protocol(settings.request_timeout, settings.max_connections), proxy_headers=False)


def _system_arrow_pool() -> None:
    """Arrow's memory in this process from the C allocator, unless the operator chose a pool
    (ARROW_DEFAULT_MEMORY_POOL). The files the service builds for downloads (api.jobs.soft_label_packing,
    api.jobs.job_outputs) allocate through Arrow, whose default pool (mimalloc) keeps what they free:
    about 30 MiB more at each build's peak. Arrow reads the variable once, when this process
    first asks for its pool; the jobs' drivers and Ray, started later, keep their own default."""
    chosen = os.environ.get("ARROW_DEFAULT_MEMORY_POOL")
    os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
    try:
        import pyarrow

        pyarrow.default_memory_pool()
    finally:
        if chosen is None:
            os.environ.pop("ARROW_DEFAULT_MEMORY_POOL", None)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False
