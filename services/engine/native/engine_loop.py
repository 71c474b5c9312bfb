"""The native engine on a thread of its own: it is built there and steps there; requests, aborts and
policy changes come in through a queue, between steps, and what each step and command yields (frames,
pulls, released KV: events.py) goes out to `deliver`."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from ..state import EngineState
from ..steps import StepLog
from .engine import Engine
from .events import EngineEvents

log = logging.getLogger(__name__)

T = TypeVar("T")

STATE_EVERY_S = 0.05  # how stale GET /v1/state, /metrics and the heartbeat load may be while the engine is busy


class EngineLoop:
    """Builds the engine and runs `Engine.step()` on one thread of its own; new requests, aborts and
    policy changes come in through a queue and are applied between steps.

    Building on the stepping thread keeps one OpenMP team in the process. Loading the weights runs
    torch's parallel kernels, and the team of the thread that ran them lives as long as that thread.
    libgomp counts the threads of every team, and once they outnumber the CPUs it spins only 100
    times before it sleeps: a team left on the main thread made the step's worker thread sleep and be
    woken through a futex at every parallel region, 600-900 times a second under load."""

    def __init__(self, build: Callable[[], Engine], deliver: Callable[[EngineEvents], None]):
        self.deliver = deliver
        self.engine: Engine | None = None
        self.state: EngineState | None = None
        self.steps = StepLog()  # each step's shape and the wall time of its turn of the loop
        self._build = build
        self._built: Future[Engine] = Future()
        self._commands: queue.SimpleQueue[Callable[[], EngineEvents | None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self, timeout_s: float = 600.0) -> Engine:
        """Build the engine on the loop's thread and start stepping it; raises what building raised."""
        self._thread.start()
        return self._built.result(timeout_s)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join()

    def submit(self, command: Callable[[], EngineEvents | None]) -> None:
        """Run `command` on the engine thread between steps; the events it returns are delivered."""
        self._commands.put(command)
        self._wake.set()

    def call(self, fn: Callable[[], tuple[T, EngineEvents | None]]) -> Future[T]:
        """Like submit, for a command with a result: `fn` returns (result, events to deliver)."""
        future: Future[T] = Future()

        def command() -> EngineEvents | None:
            try:
                result, events = fn()
            except Exception as exc:
                future.set_exception(exc)
                return None
            future.set_result(result)
            return events

        self.submit(command)
        return future

    def _run(self) -> None:
        try:
            self.engine = self._build()
            self.state = self.engine.state()
        except BaseException as exc:  # noqa: BLE001 - handed to start()'s caller
            self._built.set_exception(exc)
            return
        self._built.set_result(self.engine)
        published = 0.0
        while not self._stop.is_set():
            turn, stepped = time.perf_counter(), self.engine.steps
            events = self._drain()
            if self.engine.scheduler.has_work():
                try:
                    events += self.engine.step()
                except Exception:
                    log.exception("engine step failed; failing the requests it held")
                    events += self._fail_all()
            expired, next_lease = self.engine.expire_leases(self.engine.clock())
            events += expired
            idle = not self.engine.scheduler.has_work()
            if idle or time.monotonic() - published > STATE_EVERY_S:  # not every step: it is the hot loop
                self.state, published = self.engine.state(), time.monotonic()
            if events:
                self.deliver(events)
            if self.engine.steps != stepped:  # a step computed something: its turn, as the simulator's step
                self.steps.record(self.engine.steps, self.engine.clock(), time.perf_counter() - turn,
                                  self.engine.last_shape, self.engine.last_staged_bytes, self.engine.last_pushed_bytes)
            if idle:
                # A command submitted meanwhile has set it: the next drain takes it. Held KV is
                # checked again when its lease runs out.
                self._wake.wait(next_lease)
                self._wake.clear()

    def _drain(self) -> EngineEvents:
        events = EngineEvents()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return events
            try:
                events += command()
            except Exception:
                log.exception("engine command failed")

    def _fail_all(self) -> EngineEvents:
        scheduler = self.engine.scheduler
        requests = [*scheduler.running, *scheduler.waiting, *scheduler.swapped, *scheduler.pulling]
        return EngineEvents(frames=[frame for r in requests for frame in self.engine.abort(r.request_id, "error")])
