"""Service configuration: embedded defaults, then a TOML file, then environment variables.

Precedence, lowest first:
  1. the defaults on the config struct;
  2. top-level keys of the file (shared by every service: `cluster`, `token`, ...);
  3. the file's table named after the service (`[kvmeta]`);
  4. `KVMESH_<FIELD>` (shared), then `KVMESH_<SERVICE>_<FIELD>` (this service only).
The file comes from `--config` or `KVMESH_CONFIG`. Values from the environment are strings; they are
converted to the field's type (JSON for lists and tables), and a bad value is a clear error.
"""

from __future__ import annotations

import json
import re
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec

C = TypeVar("C", bound="ServiceConfig")

SECRET_FIELDS = frozenset({"token", "api_key", "api_keys"})
_URL_PASSWORD = re.compile(r"(://[^:/@]*:)[^@]*@")


class ConfigError(ValueError):
    pass


class ServiceConfig(msgspec.Struct, kw_only=True):
    """What every service reads; each service's config struct extends it."""

    host: str = "127.0.0.1"
    port: int = 0
    # A listening socket inherited from a supervisor (`kvmesh up` holds the stateless services'), served
    # instead of binding host:port, so that connections made while the service restarts wait for it.
    listen_fd: int | None = None
    cluster: str = "default"
    # Service token for internal endpoints. None leaves them open (`kvmesh up` always sets one).
    token: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    # A request body must arrive within this long: a client sending it one byte a second gets a 408
    # instead of holding its handler (and whatever the handler would take) indefinitely.
    body_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    log_level: str = "INFO"
    log_format: Literal["text", "json"] = "text"  # json: one object a line, with trace and request ids
    # Tracing (docs/observability.md): off unless spans have somewhere to go.
    trace_file: str | None = None        # append spans to this JSON-lines file
    otlp_endpoint: str | None = None     # export spans over OTLP (a collector, Jaeger, Tempo)
    otlp_protocol: Literal["http/protobuf", "grpc"] = "http/protobuf"
    trace_sample: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 1.0  # fraction of new traces sampled; children follow their parent


def load_config(cls: type[C], service: str | None, path: str | Path | None = None,
                env: Mapping[str, str] = os.environ) -> C:
    """The config of `service`; with None, only what all services share (top-level keys, KVMESH_<FIELD>)."""
    path = path or env.get("KVMESH_CONFIG")
    fields = set(cls.__struct_fields__)
    data: dict[str, Any] = {}
    if path:
        try:
            document = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        data.update({k: v for k, v in document.items() if k in fields and not isinstance(v, dict)})
        own = document.get(service, {}) if service else {}
        unknown = set(own) - fields
        if unknown:
            raise ConfigError(f"[{service}] in {path} has unknown keys: {', '.join(sorted(unknown))}")
        data.update(own)
    for prefix in ("KVMESH_", f"KVMESH_{service.upper()}_") if service else ("KVMESH_",):
        for field in fields:
            value = env.get(prefix + field.upper())
            if value is not None:
                data[field] = _from_env(value)
    try:
        return msgspec.convert(data, cls, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid {service or 'shared'} configuration: {exc}") from None


def _from_env(value: str) -> Any:
    if value[:1] in "[{":
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            pass
    return value


def effective(config: msgspec.Struct) -> dict[str, Any]:
    """The config as a dict with secrets masked: what a service prints when it starts."""
    shown = msgspec.to_builtins(config)
    for key, value in shown.items():
        if key in SECRET_FIELDS and value:
            shown[key] = "***"
        elif isinstance(value, str):
            shown[key] = _URL_PASSWORD.sub(r"\1***@", value)
    return shown
