"""The prefix cache's copies between the device and the cxl tier (CaR) timed on one link each way:
out (device to cxl: a node evicted for a step's room, the idle offload past the high-water mark)
and in (cxl to device: a prefetch, a reload at a turn). On each link the copies go first come,
first served, each starting when the one before it has landed, as the copies of one CUDA stream
or one copy thread do in the native engine. A copy out never waits for the in link; a copy in starts
only once the out link has copied what was queued before it: the device blocks it lands in may be
those being copied out (the count does not say which), and the node it brings back may be one still
on its way out. The native engine orders them so too (its reloads' stream waits for the compute
stream, where the offloads are copied).

A step waits before it computes for the room its offloads make; the copies in begun with it, its
own reloads (layer by layer, CaR III-C.1) and its prefetches (III-B.2), run under its compute, and
it ends once they have landed: the native engine copies both on its side copier inside the step's
model run and settles them before the step ends (layer_staging.py's LayerLoads), though no
attention of the step reads a prefetched node. A step that computes nothing copies them at once
there (flush_loads) and takes no time here, so a later step holding a prefetched node that has not
landed waits for it before it computes. The idle offload is waited for by no step: it holds its
link, so what is queued behind it starts later."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class Link:
    """One direction: copies back to back, first come, first served."""

    bytes_per_s: float
    free_at: float = 0.0   # when the last copy queued lands

    def copy(self, now: float, nbytes: int) -> float:
        """Queue a copy of `nbytes` at `now`; when it lands."""
        self.free_at = max(now, self.free_at) + nbytes / self.bytes_per_s
        return self.free_at


class CacheLinks:
    def __init__(self, out_bytes_per_s: float, in_bytes_per_s: float):
        self.out, self.into = Link(out_bytes_per_s), Link(in_bytes_per_s)
        self.now = 0.0
        self.landing: dict[str, float] = {}   # prefetched node -> when it lands, until it has
        self.room_at = self.loaded_at = 0.0   # when this step's room offloads, its reloads, have landed

    def at(self, now: float) -> None:
        """The clock: copies from here on are queued at `now` (a step's schedule, or its end)."""
        self.now = self.room_at = self.loaded_at = now
        if self.landing:
            self.landing = {node: at for node, at in self.landing.items() if at > now}

    def copied(self, why: str, nbytes: int, nodes: Iterable[str]) -> None:
        """A copy made now, by why (prefix_count.py's `copied` keys), of `nodes`."""
        if why == "offload" or why == "offload_idle":
            landed = self.out.copy(self.now, nbytes)
            if why == "offload":
                self.room_at = max(self.room_at, landed)
            for node in nodes:   # out again: whatever it waited for is moot
                self.landing.pop(node, None)
        else:
            self.loaded_at = self.into.copy(max(self.now, self.out.free_at), nbytes)
            if why == "prefetch":
                self.landing.update(dict.fromkeys(nodes, self.loaded_at))

    def waits(self, held: Iterable[str]) -> tuple[float, float]:
        """For a step scheduled now whose requests hold the nodes `held`: how long it waits before it
        computes (its room, prefetched nodes still in flight), and how long the copies in begun with
        it (reloads, prefetches) run after that."""
        ready = max([self.room_at, *(self.landing.get(node, self.now) for node in held)])
        return ready - self.now, max(0.0, self.loaded_at - ready)
