"""The service's settings: environment variables, or one YAML file naming the same keys.

`fadrm serve` reads them once at start (`ServiceSettings.load`); a missing token or a bad value
stops the start with one line naming the key. The environment wins over the file.

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
| FADRM_RAY_CPUS | CPUs of the local Ray head (default: this machine's) |
| FADRM_DEVICE | cpu, or cuda (one GPU per distill actor) |
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

ENV_PREFIX = "FADRM_"
FILE_ENV = "FADRM_SERVE_CONFIG"  # a YAML file of the keys below (also `fadrm serve --config`)


class SettingsError(ValueError):
    """A service setting that is missing or bad (one line, names the key)."""


class ServiceSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

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
    threads: int = Field(1, ge=1)
    ray_cpus: int | None = Field(None, ge=1)
    device: Literal["cpu", "cuda"] = "cpu"
    max_body_bytes: int = Field(64 * 1024, ge=1024)

    @property
    def state_dir(self) -> Path:
        """Where the service keeps its job records and per-job files (beside the runs)."""
        return self.store / ".fadrm-api"

    @classmethod
    def load(cls, config_file: str | os.PathLike | None = None, environ: dict | None = None) -> "ServiceSettings":
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        config_file = config_file or environ.get(FILE_ENV)
        if config_file:
            values.update(_read_file(Path(config_file)))
        for name in cls.model_fields:
            raw = environ.get(ENV_PREFIX + name.upper())
            if raw not in (None, ""):
                values[name] = raw
        if not values.get("api_token"):
            raise SettingsError("FADRM_API_TOKEN is not set: the service refuses to start without a token")
        for name in ("store", "teachers"):
            if not values.get(name):
                raise SettingsError(f"FADRM_{name.upper()} is not set")
        try:
            settings = cls.model_validate(values)
        except ValidationError as exc:
            err = exc.errors()[0]
            key = ENV_PREFIX + str(err["loc"][0]).upper() if err["loc"] else "settings"
            shown = "(hidden)" if key == "FADRM_API_TOKEN" else repr(err.get("input"))
            raise SettingsError(f"{key}: {err['msg']}, got {shown}") from None
        if not settings.teachers.is_dir():
            raise SettingsError(f"FADRM_TEACHERS: {settings.teachers} is not a folder")
        if settings.datasets is not None and not settings.datasets.is_file():
            raise SettingsError(f"FADRM_DATASETS: {settings.datasets} is not a file")
        return settings


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise SettingsError(f"settings file {path} does not exist")
    loaded = yaml.safe_load(path.read_text()) or {}
    if not isinstance(loaded, dict):
        raise SettingsError(f"settings file {path} must hold a mapping of KEY: value")
    out = {}
    for key, value in loaded.items():
        name = str(key).lower().removeprefix(ENV_PREFIX.lower())
        if name not in ServiceSettings.model_fields:
            raise SettingsError(f"settings file {path}: unknown key {key}")
        out[name] = value
    return out
