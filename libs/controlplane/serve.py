"""Running a service process: the effective config, uvloop, graceful shutdown."""

from __future__ import annotations

import asyncio
import faulthandler
import json
import logging
import signal
import socket

from aiohttp import web

from .config import effective
from .service import ServerSpans, Service

log = logging.getLogger(__name__)

# Connections the kernel keeps waiting to be accepted (aiohttp's default is 128): a burst of clients,
# or those that arrive while a supervised service restarts on its held socket, wait rather than fail.
LISTEN_BACKLOG = 1024


def run(service: Service, spans: ServerSpans | None = None) -> None:
    """Serve until SIGINT/SIGTERM; aiohttp finishes in-flight requests and runs the lifespans' teardown.
    The caller has set up logging and tracing (`kvmesh serve` does, from the same config) and gives
    what makes the requests' spans."""
    config = service.config
    # A supervisor whose SIGTERM went unanswered sends SIGUSR1 before SIGKILL: every thread's stack
    # lands in this process's log, so a hung shutdown says where it hung.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    log.info("effective config: %s", json.dumps(effective(config), sort_keys=True))
    if not config.token:
        log.warning("no service token configured: internal endpoints are open to anyone who can reach %s:%s",
                    config.host, config.port)
    try:
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    where = {"sock": socket.socket(fileno=config.listen_fd)} if config.listen_fd is not None \
        else {"host": config.host, "port": config.port}
    web.run_app(service.build(spans), **where, backlog=LISTEN_BACKLOG, access_log=None,
                print=lambda *_: log.info("%s listening on http://%s:%s", service.name, config.host, config.port),
                shutdown_timeout=5.0)
