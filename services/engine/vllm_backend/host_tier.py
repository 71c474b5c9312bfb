"""The cxl tier's bytes on a vLLM engine (worker side of KVMeshConnector): a slot holds one block of
every layer, in host memory (pinned when the KV cache is on a GPU, so copies are DMA).

Copies run on a thread of their own, in order (blocks consecutive on both sides as one slice copy,
block_manager.copy_block_rows), each layer's as a separate job, so they overlap the
model's compute: a step's loads (every layer, in the model's order) are queued when the step starts
and `wait_for_layer` waits only for the layer about to run; a layer's saves are queued right after
that layer has computed and `wait_for_saves` waits for them at the end of the step, before vLLM may
reuse the blocks. On a GPU each copy goes on a side stream, after an event of the compute stream.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..kv_blocks import copy_block_rows


class HostTier:
    def __init__(self, caches: dict[str, torch.Tensor], capacity: int):
        self.caches = caches
        self.device = next(iter(caches.values())).device
        on_gpu = self.device.type == "cuda"
        self.slots = {name: torch.empty((capacity, *cache.shape[1:]), dtype=cache.dtype, device="cpu",
                                        pin_memory=on_gpu) for name, cache in caches.items()}
        self.slot_bytes = sum(s[0].numel() * s.element_size() for s in self.slots.values()) if capacity else 0
        self._stream = torch.cuda.Stream(self.device) if on_gpu else None
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="kvmesh-cxl-tier")
        self._loads: dict[str, Future[None]] = {}
        self._saves: list[Future[None]] = []
        self.load_seconds = 0.0   # all time: the copy thread's time loading blocks back

    def start_loads(self, slots: list[int], blocks: list[int]) -> None:
        """Copy `slots` into the KV cache's `blocks`, every layer, in the model's order."""
        for name in self.caches:
            self._loads[name] = self._copier.submit(self._load, name, slots, blocks)

    def wait_for_layer(self, name: str) -> None:
        load = self._loads.pop(name, None)
        if load is not None:
            load.result()

    def save_layer(self, name: str, blocks: list[int], slots: list[int]) -> None:
        """Queue the copy of a layer's `blocks` (just computed) into `slots`."""
        computed = None
        if self._stream is not None:
            computed = torch.cuda.Event()
            computed.record()
        self._saves.append(self._copier.submit(self._save, name, blocks, slots, computed))

    def wait_for_saves(self) -> None:
        """Every copy queued this step is over (loads of layers the step never ran included)."""
        for job in [*self._loads.values(), *self._saves]:
            job.result()
        self._loads, self._saves = {}, []

    def close(self) -> None:
        self._copier.shutdown(wait=True, cancel_futures=True)

    def _load(self, name: str, slots: list[int], blocks: list[int]) -> None:
        started = time.perf_counter()
        with self._on_side_stream():
            copy_block_rows(self.slots[name], slots, self.caches[name], blocks)
        self.load_seconds += time.perf_counter() - started

    def _save(self, name: str, blocks: list[int], slots: list[int], computed: torch.cuda.Event | None) -> None:
        with self._on_side_stream():
            if computed is not None:
                self._stream.wait_event(computed)
            copy_block_rows(self.caches[name], blocks, self.slots[name], slots)

    @contextlib.contextmanager
    def _on_side_stream(self):
        if self._stream is None:
            yield
            return
        with torch.cuda.stream(self._stream):
            yield
        self._stream.synchronize()
