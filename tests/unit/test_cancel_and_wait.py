"""Background tasks end at shutdown even when a cancel is swallowed, and never hold it up for long."""

from __future__ import annotations

import asyncio

from kvmesh.libs.controlplane import cancel_and_wait


async def _swallows_first_cancel(ended: list[str]) -> None:
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        pass  # as a library that turns a cancel into its own error, caught by a retry loop
    try:
        await asyncio.sleep(3600)
    finally:
        ended.append("second cancel")


async def _ignores_cancels(released: asyncio.Event) -> None:
    while not released.is_set():
        try:
            await released.wait()
        except asyncio.CancelledError:
            continue


async def test_a_swallowed_cancel_is_repeated_until_the_task_ends():
    ended: list[str] = []
    task = asyncio.create_task(_swallows_first_cancel(ended))
    await asyncio.sleep(0)
    await cancel_and_wait([task])
    assert task.cancelled() and ended == ["second cancel"]


async def test_a_task_that_ignores_cancels_is_left_after_the_bound(caplog):
    released = asyncio.Event()
    stubborn = asyncio.create_task(_ignores_cancels(released), name="stubborn")
    polite = asyncio.create_task(asyncio.sleep(3600))
    await asyncio.sleep(0)
    await cancel_and_wait([stubborn, polite], timeout=0.3)
    assert polite.cancelled() and not stubborn.done()
    assert "stubborn" in caplog.text
    released.set()
    await stubborn
