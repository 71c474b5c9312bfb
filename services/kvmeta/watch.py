"""Join/leave events: one Redis pub/sub subscription per kvmeta process, fanned out to watchers.

A watcher that falls too far behind, or that was watching while the subscription broke (events may
have been lost), is ended; the client reconnects and starts again from a fresh snapshot.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from kvmesh.libs.kvmeta.messages import WorkerEvent

log = logging.getLogger(__name__)

_END = None  # put on a watcher's queue to end its stream


class WorkerEventHub:
    def __init__(self, redis: Redis, channel: str, queue_size: int = 1024):
        self.redis = redis
        self.channel = channel
        self.queue_size = queue_size
        self.subscribed = asyncio.Event()
        self._watchers: set[asyncio.Queue[WorkerEvent | None]] = set()

    def watch(self) -> asyncio.Queue[WorkerEvent | None]:
        queue: asyncio.Queue[WorkerEvent | None] = asyncio.Queue(self.queue_size)
        self._watchers.add(queue)
        return queue

    def unwatch(self, queue: asyncio.Queue[WorkerEvent | None]) -> None:
        self._watchers.discard(queue)

    async def run(self) -> None:
        """Relay events until cancelled; resubscribe with backoff whenever Redis goes away."""
        delay = 0.05
        while True:
            try:
                async with self.redis.pubsub() as pubsub:
                    await pubsub.subscribe(self.channel)
                    self.subscribed.set()
                    delay = 0.05
                    while True:
                        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                        if message is not None and message["type"] == "message":
                            self._fan_out(msgspec.json.decode(message["data"], type=WorkerEvent))
            except (RedisError, OSError) as exc:
                if self.subscribed.is_set():
                    log.warning("worker-event subscription lost (%s); ending %d watch streams", exc, len(self._watchers))
                self.subscribed.clear()
                self.end_all()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _fan_out(self, event: WorkerEvent) -> None:
        for queue in list(self._watchers):
            try:
                queue.put_nowait(event)
            except asyncio.QueueFull:
                log.warning("a watcher fell %d events behind; ending its stream", self.queue_size)
                self._end(queue)

    def end_all(self) -> None:
        """End every watch stream (at shutdown, or when events may have been lost)."""
        for queue in list(self._watchers):
            self._end(queue)

    def _end(self, queue: asyncio.Queue[WorkerEvent | None]) -> None:
        self._watchers.discard(queue)
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(_END)
