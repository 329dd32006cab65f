"""`fadrm serve`: run the REST service under uvicorn (settings: api/config.py)."""
from __future__ import annotations

import argparse
import json


class ServeCommand:
    name = "serve"
    help = "run the REST service (settings from FADRM_* environment variables or --config)"
    heavy = False

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--config", default=None, help="YAML file of the FADRM_* settings (the environment wins)")
        parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
        parser.add_argument("--stop-ray", action="store_true",
                            help="stop the local Ray head this store's service started, then exit")

    def run(self, args: argparse.Namespace) -> None:
        from api.config import ServiceSettings, SettingsError

        if not 0 < args.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {args.port}")
        try:
            settings = ServiceSettings.load(args.config)
        except SettingsError as exc:
            raise ValueError(str(exc)) from None
        if args.stop_ray:
            from api.executor import LocalRay

            stopped = LocalRay(settings.state_dir, settings.ray_cpus).stop()
            print(json.dumps({"stopped": stopped}) if args.json else ("stopped the local Ray head" if stopped
                                                                      else "no local Ray head was running"))
            return
        import uvicorn

        from api.app import create_app

        app = create_app(settings)  # refuses a second service on the same store before binding
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=True,
                    timeout_graceful_shutdown=10)


COMMAND = ServeCommand()
