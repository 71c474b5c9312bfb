"""aiohttp + msgpack control plane: the server and client helpers every kvmesh service uses."""

from .client import ServiceClient
from .config import ConfigError, ServiceConfig, effective, load_config
from .errors import (BadRequest, Forbidden, KvmeshError, NotFound, PayloadTooLarge, RemoteError,
                     ServiceUnavailable, ServiceUnreachable, Unauthorized, ValidationFailed)
from .service import Route, Service, read_body
from .tasks import cancel_and_wait

__all__ = ["BadRequest", "ConfigError", "Forbidden", "KvmeshError", "NotFound", "PayloadTooLarge",
           "RemoteError", "Route", "Service", "ServiceClient", "ServiceConfig", "ServiceUnavailable",
           "ServiceUnreachable", "Unauthorized", "ValidationFailed", "cancel_and_wait", "effective", "load_config",
           "read_body"]
