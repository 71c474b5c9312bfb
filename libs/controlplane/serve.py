"""Running a service process: logging, the effective config, uvloop, graceful shutdown."""

from __future__ import annotations

import asyncio
import json
import logging
import sys

from aiohttp import web

from .config import effective
from .service import Service

log = logging.getLogger(__name__)


def run(service: Service) -> None:
    """Serve until SIGINT/SIGTERM; aiohttp finishes in-flight requests and runs the lifespans' teardown."""
    config = service.config
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s {service.name} %(levelname)s %(name)s: %(message)s")
    log.info("effective config: %s", json.dumps(effective(config), sort_keys=True))
    if not config.token:
        log.warning("no service token configured: internal endpoints are open to anyone who can reach %s:%s",
                    config.host, config.port)
    try:
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    web.run_app(service.build(), host=config.host, port=config.port, access_log=None,
                print=lambda *_: log.info("%s listening on http://%s:%s", service.name, config.host, config.port),
                shutdown_timeout=5.0)
