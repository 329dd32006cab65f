"""The service's settings: environment variables, or one YAML file naming the same keys.

`fadrm serve` reads them once at start (`ServiceSettings.load`, pydantic-settings with the prefix
FADRM_); a missing or weak token or a bad value stops the start with one line naming the key.
The environment wins over the file. The limits of one request (api.planning.limits) are keys of their own
prefix, FADRM_MAX_<NAME>; in the file they are a `limits:` mapping or flat keys (`max_k`,
`FADRM_MAX_K`).

| key | meaning |
|---|---|
| FADRM_API_TOKEN | the bearer token every endpoint but /healthz requires (required, 128 bits or more) |
| FADRM_STORE | the store root: runs go to STORE/<run_id>, the service's own state to STORE/.fadrm-api |
| FADRM_TEACHERS | folder of teacher checkpoints (`NAME.pt`); requests name a teacher by its stem |
| FADRM_DATASETS | optional YAML file mapping names to dataset specs the operator allows |
| FADRM_RAY_ADDRESS | a Ray cluster to run on; without one the service starts a local Ray head |
| FADRM_MAX_RUNNING / _QUEUED | jobs running at once / waiting (past it: 429) |
| FADRM_MAX_<NAME> | the limits of one request (`limits`, api.planning.limits: FADRM_MAX_IPC, FADRM_MAX_K, ...) |
| FADRM_RATE_LIMIT / _BURST | requests per second of one token (0: no limit) / how many at once (past it: 429) |
| FADRM_MAX_BODY_BYTES | the largest request body (past it: 413) |
| FADRM_WORKERS, FADRM_THREADS | distill actors per job, torch threads of its driver |
| FADRM_CPUS_PER_WORKER | CPUs each distill actor reserves (default 1) |
| FADRM_RAY_CPUS | CPUs of the local Ray head (default: this machine's) |
| FADRM_DEVICE | cpu, or cuda (one GPU per distill actor) |
| FADRM_PRIVATE_TEACHERS | true: GET .../teacher answers 403 (the operator keeps teacher checkpoints private) |
| FADRM_REQUEST_TIMEOUT | seconds a request may take to arrive whole (past it: 408, connection closed) |
| FADRM_MAX_CONNECTIONS | connections open at once (past it: 503 and closed at once) |
| FADRM_ANON_RATE_LIMIT / _BURST | requests per second / at once of one address without a valid token |
| FADRM_LOG_FILE, _LOG_MAX_BYTES, _LOG_BACKUPS | the service's log file (else stderr/stdout), rotated by size |
| FADRM_DRIVER_LOG_MAX_BYTES | the size at which a job's driver.log is rotated (one old file kept) |
| FADRM_JOB_RETENTION | how long finished job records and their files are kept (seconds, or 30m, 12h, 7d) |
| FADRM_MAX_JOB_RECORDS | job records kept at most (the oldest finished ones go first) |
| FADRM_DRIVER_HEARTBEAT_TIMEOUT | seconds without a heartbeat after which a running job's driver is failed |
| FADRM_TRUSTED_PROXIES | addresses or networks of proxies whose X-Forwarded-For names the client (default none) |
"""
from __future__ import annotations

import ipaddress
import math
import os
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from fadrm_ray.errors import InputError
from fadrm_ray.fileio import read_yaml_mapping

from api.planning.limits import RequestLimits

ENV_PREFIX = "FADRM_"
LIMITS_PREFIX = RequestLimits.model_config["env_prefix"]
MAKE_TOKEN = 'python -c "import secrets; print(secrets.token_urlsafe(32))"'
FILE_ENV = "FADRM_SERVE_CONFIG"  # a YAML file of the keys below (also `fadrm serve --config`)


class SettingsError(InputError):
    """A service setting that is missing or bad (one line, names the key)."""


class _SettingsFile(PydanticBaseSettingsSource):
    """The YAML settings file: the same keys as the environment (`FADRM_STORE` or `store`); the
    limits as a `limits:` mapping or flat (`max_k`, `FADRM_MAX_K`)."""

    def __init__(self, settings_cls, path: Path):
        super().__init__(settings_cls)
        self.path = path

    def get_field_value(self, field, field_name):  # the whole file is read in __call__
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        out, limits = {}, {}
        for key, value in read_yaml_mapping(self.path, f"settings file {self.path}", SettingsError).items():
            name = str(key).lower().removeprefix(ENV_PREFIX.lower())
            if name == "limits":
                if not isinstance(value, dict):
                    raise SettingsError(f"settings file {self.path}: limits must be a mapping of limit names")
                for limit, number in value.items():
                    limit = str(limit).lower().removeprefix(LIMITS_PREFIX.lower()).removeprefix("max_")
                    if limit not in RequestLimits.model_fields:
                        raise SettingsError(f"settings file {self.path}: unknown limit {limit}")
                    limits[limit] = number
            elif name not in self.settings_cls.model_fields and name.removeprefix("max_") in RequestLimits.model_fields:
                limits[name.removeprefix("max_")] = value
            elif name not in self.settings_cls.model_fields:
                raise SettingsError(f"settings file {self.path}: unknown key {key}")
            else:
                out[name] = value
        if limits:
            # The limits are validated as one RequestLimits, whose own environment source would
            # give way to these values: the environment's limits are laid over them here instead.
            out["limits"] = {**limits, **EnvSettingsSource(RequestLimits)()}
        return out


_FILE: ContextVar[Path | None] = ContextVar("fadrm_settings_file", default=None)


class ServiceSettings(BaseSettings):
    # Environment variables first, then the file (pydantic-settings' sources, in that order).
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True, case_sensitive=False,
                                      env_ignore_empty=True)

    api_token: str = Field(repr=False)
    store: Path
    teachers: Path
    datasets: Path | None = None
    ray_address: str | None = None
    max_running: int = Field(2, ge=1)
    max_queued: int = Field(16, ge=0)
    # Built from its own FADRM_MAX_* variables when no file names them (validating {} runs
    # RequestLimits' settings sources).
    limits: RequestLimits = Field(default_factory=dict, validate_default=True)
    rate_limit: float = Field(20.0, ge=0)  # requests per second of one token; 0: none
    rate_burst: int = Field(40, ge=1)
    workers: int | None = Field(None, ge=1)
    cpus_per_worker: float = Field(1.0, gt=0)
    threads: int = Field(1, ge=1)
    ray_cpus: int | None = Field(None, ge=1)
    device: Literal["cpu", "cuda"] = "cpu"
    max_body_bytes: int = Field(64 * 1024, ge=1024)
    # A job's teacher checkpoint is served to its clients (GET .../teacher) unless the operator keeps it.
    private_teachers: bool = False
    # Connections (api.web.http.guarded_protocol): a request must arrive whole within request_timeout
    # seconds; at most max_connections are open at once.
    request_timeout: float = Field(10.0, gt=0)
    max_connections: int = Field(256, ge=1)
    # Requests without a valid token, per client address (401 and 403 included); 0: no limit.
    anon_rate_limit: float = Field(5.0, ge=0)
    anon_rate_burst: int = Field(20, ge=1)
    # Logs: without log_file, uvicorn's streams (stderr, stdout); each file rotated by size.
    log_file: Path | None = None
    log_max_bytes: int = Field(10 * 2**20, ge=4096)
    log_backups: int = Field(3, ge=0)
    driver_log_max_bytes: int = Field(16 * 2**20, ge=4096)
    # Job records: finished ones older than job_retention seconds go, files and all, and never
    # more than max_job_records are kept.
    job_retention: float = Field(7 * 86400.0, gt=0)
    max_job_records: int = Field(10_000, ge=1)
    # Job folders without a record (a service killed between removing a record and its folder)
    # are looked for by the first sweep, then by a sweep at most this often (0: every sweep).
    orphan_interval: float = Field(3600.0, ge=0)
    driver_heartbeat_timeout: float = Field(120.0, gt=0)
    # The proxies (addresses or networks) whose X-Forwarded-For header names the client: the
    # address limits and the access log then see the client's address, not the proxy's. Empty:
    # every request's client is the socket's peer, whatever it writes in its headers.
    trusted_proxies: Annotated[tuple[str, ...], NoDecode] = ()

    @field_validator("trusted_proxies", mode="before")
    @classmethod
    def _networks(cls, value):
        """A comma-separated list (or a YAML list) of addresses or networks, each normalized."""
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ValueError("a comma-separated list of addresses or networks (10.0.0.5, 10.0.0.0/24)")
        out = []
        for item in (str(i).strip() for i in items):
            if not item:
                continue
            try:
                network = ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise ValueError(f"not an address or a network: {item[:60]!r}") from None
            out.append(str(network.network_address) if network.num_addresses == 1 else str(network))
        return tuple(dict.fromkeys(out))

    @field_validator("job_retention", "orphan_interval", mode="before")
    @classmethod
    def _duration(cls, value):
        """Seconds, or a number with a unit: 90s, 30m, 12h, 7d."""
        if isinstance(value, str) and value.strip()[-1:].lower() in _UNITS:
            text = value.strip()
            try:
                return float(text[:-1]) * _UNITS[text[-1].lower()]
            except ValueError:
                raise ValueError(f"not a duration (seconds, or 30m, 12h, 7d): {value!r}") from None
        return value

    @field_validator("api_token")
    @classmethod
    def _strong(cls, token: str) -> str:
        if weakness := token_weakness(token):
            raise ValueError(weakness)
        return token

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
            loc = [str(part) for part in err["loc"]]
            name = loc[0] if loc else ""
            if name == "limits" and len(loc) > 1:
                key = LIMITS_PREFIX + loc[1].upper()
            else:
                key = ENV_PREFIX + name.upper() if name else "settings"
            if err["type"] == "missing":
                if name == "api_token":
                    raise SettingsError("FADRM_API_TOKEN is not set: the service refuses to start without a token; "
                                        f"make one with {MAKE_TOKEN}") from None
                raise SettingsError(f"{key} is not set") from None
            if name == "api_token" and err["type"] == "value_error":
                raise SettingsError(f"FADRM_API_TOKEN {err['ctx']['error']}") from None
            shown = "(hidden)" if name == "api_token" else repr(err.get("input"))
            raise SettingsError(f"{key}: {err['msg']}, got {shown}") from None
        finally:
            _FILE.reset(token)
        if not settings.teachers.is_dir():
            raise SettingsError(f"FADRM_TEACHERS: {settings.teachers} is not a folder")
        if settings.datasets is not None and not settings.datasets.is_file():
            raise SettingsError(f"FADRM_DATASETS: {settings.datasets} is not a file")
        return settings


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_HEX = frozenset("0123456789abcdefABCDEF")
_BASE64 = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/-_")


def token_weakness(token: str) -> str | None:
    """Why `token` is too weak to guard the service (None when it is strong enough): fewer than
    128 bits if its characters were drawn at random from its alphabet (32 hex characters, or 22
    base64/base64url ones), or a pattern no random draw makes."""
    body = token.rstrip("=")  # base64 padding carries nothing
    if not body.isascii() or not body.isprintable() or " " in body:
        return f"must be printable ASCII without spaces; make one with {MAKE_TOKEN}"
    alphabet = 16 if set(body) <= _HEX else 64 if set(body) <= _BASE64 else 95
    bits = len(body) * math.log2(alphabet)
    # A random token of 32 hex characters has fewer than 8 distinct ones practically never;
    # one that repeats a shorter string (abcabc...) is a pattern, whatever its length.
    repeats = body in (body + body)[1:-1]
    if bits < 128 or len(set(body)) < 8 or repeats:
        return ("is too weak: it needs 128 bits of entropy (32 hex or 22 base64url characters or more, drawn at "
                f"random, not a pattern); make one with {MAKE_TOKEN}")
    return None
