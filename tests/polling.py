"""Waiting in a test for another process to catch up: one poll, so every wait has a deadline and a
failure says what it last saw."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any


async def eventually(probe: Callable[[], Awaitable[Any]], until: Callable[[Any], Any] | None = None,
                     timeout: float = 10.0, interval: float = 0.1,
                     retry: tuple[type[BaseException], ...] = ()) -> Any:
    """Await `probe()` every `interval` seconds until `until` accepts its result (without `until`,
    until it returns at all); returns that result. A `retry` exception means not yet. Past `timeout`
    seconds: AssertionError naming the last result, or the last such exception raised again."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            result = await probe()
        except retry:
            if loop.time() > deadline:
                raise
        else:
            if until is None or until(result):
                return result
            if loop.time() > deadline:
                raise AssertionError(f"not so within {timeout} s; last: {result!r}")
        await asyncio.sleep(interval)
