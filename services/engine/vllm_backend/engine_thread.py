"""A stock vLLM engine (`vllm.v1.engine.llm_engine.LLMEngine`, its core in this process) on a thread
of its own, as the native engine's EngineLoop runs kvmesh's: the thread builds the engine (vLLM's CPU
build binds the OMP threads of the thread that builds it, so that thread must also step it), then
steps while there is work and runs what the service asks of it between two steps. Each step's
outputs go to `on_outputs`, and `observe(engine)` reads the engine between steps, both on this thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05   # nothing to step: how long to wait for a command before looking again
HELD_WAIT_S = 0.002  # only held or pulled KV left: step slowly, leaving the GIL to the data plane's thread


class VllmThread:
    def __init__(self, build: Callable[[], Any], on_outputs: Callable[[list], None],
                 observe: Callable[[Any], None]):
        self._build, self._on_outputs, self._observe = build, on_outputs, observe
        self._commands: queue.SimpleQueue[tuple[Callable[[Any], Any], Future]] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._started: Future = Future()
        self._thread = threading.Thread(target=self._run, name="vllm-engine", daemon=True)
        self.engine: Any = None

    def start(self, timeout_s: float = 600.0) -> None:
        """Build the engine on the thread; raises what building it raised."""
        self._thread.start()
        self._started.result(timeout_s)

    def call(self, fn: Callable[[Any], Any]) -> Future:
        """fn(engine) between two steps, on the engine's thread; its result in the future."""
        future: Future = Future()
        self._commands.put((fn, future))
        return future

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            self.engine = self._build()
            self._observe(self.engine)
        except BaseException as exc:  # noqa: BLE001 - handed to start()'s caller
            self._started.set_exception(exc)
            return
        self._started.set_result(None)
        scheduler = self.engine.engine_core.engine_core.scheduler
        try:
            while not self._stopping.is_set():
                busy = scheduler.has_requests()
                self._run_commands(wait_s=0 if busy and scheduler.get_num_unfinished_requests() else
                                   HELD_WAIT_S if busy else IDLE_WAIT_S)
                if scheduler.has_requests():
                    outputs = self.engine.step()
                    if outputs:
                        self._on_outputs(outputs)
                self._observe(self.engine)
        finally:
            self._run_commands(wait_s=0)
            self.engine.engine_core.shutdown()   # the connector's too: its data plane closes

    def _run_commands(self, wait_s: float) -> None:
        try:
            command = self._commands.get(timeout=wait_s) if wait_s else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, future = command
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except Exception as exc:  # noqa: BLE001 - the caller's to handle
                    future.set_exception(exc)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
