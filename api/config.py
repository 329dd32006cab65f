"""The service's settings: environment variables, or one YAML file naming the same keys.

`fadrm serve` reads them once at start (`ServiceSettings.load`, pydantic-settings with the prefix
FADRM_); a missing token or a bad value stops the start with one line naming the key. The
environment wins over the file.

| key | meaning |
|---|---|
| FADRM_API_TOKEN | the bearer token every endpoint but /healthz requires (required) |
| FADRM_STORE | the store root: runs go to STORE/<run_id>, the service's own state to STORE/.fadrm-api |
| FADRM_TEACHERS | folder of teacher checkpoints (`NAME.pt`); requests name a teacher by its stem |
| FADRM_DATASETS | optional YAML file mapping names to dataset specs the operator allows |
| FADRM_RAY_ADDRESS | a Ray cluster to run on; without one the service starts a local Ray head |
| FADRM_MAX_RUNNING / _QUEUED | jobs running at once / waiting (past it: 429) |
| FADRM_MAX_IPC / _IMAGES | the largest IPC, and classes x IPC, one request may ask for |
| FADRM_WORKERS, FADRM_THREADS | distill actors per job, torch threads of its driver |
| FADRM_CPUS_PER_WORKER | CPUs each distill actor reserves (default 1) |
| FADRM_RAY_CPUS | CPUs of the local Ray head (default: this machine's) |
| FADRM_DEVICE | cpu, or cuda (one GPU per distill actor) |
"""
from __future__ import annotations

import os
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from fadrm_ray.fileio import read_yaml_mapping

ENV_PREFIX = "FADRM_"
FILE_ENV = "FADRM_SERVE_CONFIG"  # a YAML file of the keys below (also `fadrm serve --config`)


class SettingsError(ValueError):
    """A service setting that is missing or bad (one line, names the key)."""


class _SettingsFile(PydanticBaseSettingsSource):
    """The YAML settings file: the same keys as the environment (`FADRM_STORE` or `store`)."""

    def __init__(self, settings_cls, path: Path):
        super().__init__(settings_cls)
        self.path = path

    def get_field_value(self, field, field_name):  # the whole file is read in __call__
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        out = {}
        for key, value in read_yaml_mapping(self.path, f"settings file {self.path}", SettingsError).items():
            name = str(key).lower().removeprefix(ENV_PREFIX.lower())
            if name not in self.settings_cls.model_fields:
                raise SettingsError(f"settings file {self.path}: unknown key {key}")
            out[name] = value
        return out


_FILE: ContextVar[Path | None] = ContextVar("fadrm_settings_file", default=None)


class ServiceSettings(BaseSettings):
    # Environment variables first, then the file (pydantic-settings' sources, in that order).
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True, case_sensitive=False,
                                      env_ignore_empty=True)

    api_token: str = Field(min_length=16, repr=False)
    store: Path
    teachers: Path
    datasets: Path | None = None
    ray_address: str | None = None
    max_running: int = Field(2, ge=1)
    max_queued: int = Field(16, ge=0)
    max_ipc: int = Field(50, ge=1)
    max_images: int = Field(2000, ge=1)
    workers: int | None = Field(None, ge=1)
    cpus_per_worker: float = Field(1.0, gt=0)
    threads: int = Field(1, ge=1)
    ray_cpus: int | None = Field(None, ge=1)
    device: Literal["cpu", "cuda"] = "cpu"
    max_body_bytes: int = Field(64 * 1024, ge=1024)

    @property
    def state_dir(self) -> Path:
        """Where the service keeps its job records and per-job files (beside the runs)."""
        return self.store / ".fadrm-api"

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        path = _FILE.get()
        return (init_settings, env_settings, *((_SettingsFile(settings_cls, path),) if path else ()))

    @classmethod
    def load(cls, config_file: str | os.PathLike | None = None) -> "ServiceSettings":
        """The settings from the environment and the file (`config_file`, else $FADRM_SERVE_CONFIG),
        or SettingsError naming the key."""
        config_file = config_file or os.environ.get(FILE_ENV)
        token = _FILE.set(Path(config_file) if config_file else None)
        try:
            settings = cls()
        except ValidationError as exc:
            err = exc.errors()[0]
            name = str(err["loc"][0]) if err["loc"] else ""
            key = ENV_PREFIX + name.upper() if name else "settings"
            if err["type"] == "missing":
                if name == "api_token":
                    raise SettingsError("FADRM_API_TOKEN is not set: the service refuses to start without a token") from None
                raise SettingsError(f"{key} is not set") from None
            shown = "(hidden)" if name == "api_token" else repr(err.get("input"))
            raise SettingsError(f"{key}: {err['msg']}, got {shown}") from None
        finally:
            _FILE.reset(token)
        if not settings.teachers.is_dir():
            raise SettingsError(f"FADRM_TEACHERS: {settings.teachers} is not a folder")
        if settings.datasets is not None and not settings.datasets.is_file():
            raise SettingsError(f"FADRM_DATASETS: {settings.datasets} is not a file")
        return settings
