"""Ending a service's background tasks at shutdown, within a bound."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

log = logging.getLogger(__name__)


async def cancel_and_wait(tasks: Iterable[asyncio.Task], timeout: float = 2.0) -> None:
    """Cancel `tasks` and wait for them to end, cancelling again while any is still running.

    A single cancel() can be lost: a library that turns a CancelledError into its own error in a
    `try` around I/O (a Redis client racing its own read timeout, say) leaves a retry loop running,
    and a shutdown that waits on it never ends. So cancel until done, and after `timeout` leave the
    stragglers, logged, rather than hold the process up."""
    pending = {task for task in tasks if not task.done()}
    deadline = asyncio.get_running_loop().time() + timeout
    while pending:
        for task in pending:
            task.cancel()
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            log.warning("%d background tasks did not end within %.1f s of being cancelled: %s",
                        len(pending), timeout, ", ".join(task.get_name() for task in pending))
            return
        _, pending = await asyncio.wait(pending, timeout=min(0.1, left))
