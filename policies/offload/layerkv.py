"""LayerKV's layer-wise KV allocation (3.1.1-3.1.2): how many layers a request keeps on the device
(Eq. 4), which ones (interleaved across depth), and offloading retained layers of running requests
when the free-block forecast (Eq. 5) runs below a threshold."""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.policies.prefill_admission.layerkv import prefill_time_s
from kvmesh.policies.views import PoolView, RequestView

from ..costs import OffloadCost
from .plan import OffloadInput, OffloadPlan


def offload_time_s(seqlen: int, offloaded_layers: int, cost: OffloadCost) -> float:
    """Eq. 4: T_offload = beta * seqlen * 2 (L - x) d_heads n_heads f / bandwidth. n_heads is the KV
    heads' count: with grouped-query attention that is what a layer's KV holds and what moves."""
    per_token = 2 * offloaded_layers * cost.head_dim * cost.num_kv_heads * cost.bytes_per_element
    return cost.beta * seqlen * per_token / cost.bandwidth_bytes_per_s


def retained_layers(seqlen: int, prefill_s: float, cost: OffloadCost) -> int:
    """x: the fewest layers kept on the device so that offloading the rest hides under the prefill
    (T_offload(L - x) <= T_prefill); 0 for a prompt long enough to hide them all."""
    for x in range(cost.num_layers + 1):
        if offload_time_s(seqlen, cost.num_layers - x, cost) <= prefill_s:
            return x
    return cost.num_layers


def interleaved(num_layers: int, keep: int) -> tuple[int, ...]:
    """The `keep` layers kept on the device, spread evenly across depth and ending at the last, so
    an offloaded layer's copy has the next layers' compute to hide under (3.1.2: of 8 keep 1 3 5 7)."""
    keep = max(0, min(keep, num_layers))
    return tuple((i + 1) * num_layers // keep - 1 for i in range(keep))


def forecast_free_blocks(free_now: int, running: Sequence[RequestView], num_layers: int, stages: int,
                         block_size: int = 1) -> list[int]:
    """Eq. 5, Avail(t+1) = Avail(t) + Released(t) - Allocated(t), in device blocks over all layers,
    for stages t = 1..stages. A stage is the `block_size` decode steps in which a sequence fills at
    most one block, so "each sequence requires one additional KV block" (the paper's conservative
    assumption) is one block per device layer a stage. A request is expected to end in the stage it
    reaches its predicted median length (without one, its estimate or max_tokens) and then releases
    its device blocks."""
    ends = []
    for r in running:
        median = r.estimated_output_len if r.predicted_output_median is None else r.predicted_output_median
        layers = num_layers if r.device_layers is None else r.device_layers
        ends.append((max(1, -(-(median - r.num_generated) // block_size)), layers, r.blocks_per_layer * layers))
    avail, forecast = free_now, []
    for t in range(1, stages + 1):
        released = sum(held + layers * (t - 1) for end, layers, held in ends if end == t)
        allocated = sum(layers for end, layers, _ in ends if end > t)
        avail += released - allocated
        forecast.append(avail)
    return forecast


def none(inp: OffloadInput) -> OffloadPlan:
    """Every layer of every request stays on the device (vLLM)."""
    return OffloadPlan()


def layerkv(inp: OffloadInput) -> OffloadPlan:
    """Per admitted request, every layer while the forecast has room for them, else as many as it
    has room for and at least x from Eq. 3 and 4 (3.1.2: the layers kept follow "available device
    memory and the total token count"); under a forecast shortfall, halve the device layers of the
    most recently scheduled running requests first, and if that is not enough take them all to none
    (3.1.1: "starting with x/2 layers. If this proves insufficient, the full offloading"); with room
    to spare above the threshold once the requests about to be admitted have theirs, bring
    offloaded layers back. With `decode_offloaded` "restore", a prefilled request's offloaded layers
    all come back once the free blocks hold them, before any admission; under a shortfall only
    layers no decode reads go (_restore_whole)."""
    pool = inp.pool
    free = pool.free.get("device", 0)
    # Below the threshold now, or at any stage of the horizon
    short = inp.params.threshold_blocks - min(free, *forecast_free_blocks(free, inp.running, pool.num_layers,
                                                                          inp.params.horizon_stages, pool.block_size))
    restoring = inp.params.decode_offloaded == "restore"
    # Each step, every request with an offloaded layer it computes in the staging area borrows two
    # blocks (the area's halves) for each block of a layer: room that keeping or restoring layers must leave.
    staging = 2 * sum(r.blocks_per_layer for r in inp.running
                      if _offloads(r, pool.num_layers) and not (restoring and decodes_next(r)))
    if not restoring:
        retain, slack = _retain(inp, -short - staging)
        if short > 0:
            return OffloadPlan(retain=retain, shrink=_shrink(inp.running, pool.num_layers, short))
        # the requests about to be admitted have had their room: restores get what is left
        return OffloadPlan(retain=retain, restore=_restore(inp.running, pool.num_layers, slack,
                                                           inp.params.horizon_stages))
    # A prefilled request waits for its layers: they come back before anyone is admitted, from the
    # free blocks (4: a new request "will be included in the batch if the available blocks are sufficient").
    restore, emptied, taken = _restore_whole(inp.running, pool, free - staging)
    retain, _ = _retain(inp, -short - staging - taken)
    if short > 0:  # only layers no decode reads: a decoding request's are in use (3.1.1: "until they are used")
        idle = [r for r in inp.running if r.request_id not in restore and r.request_id not in emptied
                and not _decodes_on_device(r, pool.num_layers)]
        return OffloadPlan(retain=retain, restore=restore, shrink=emptied | _shrink(idle, pool.num_layers, short))
    return OffloadPlan(retain=retain, restore=restore, shrink=emptied)


def decodes_next(r: RequestView) -> bool:
    """Whether the request's next step is a decode (its prompt computed, a token sampled)."""
    return r.num_generated > 0 and r.num_computed == r.num_tokens - 1


def _offloads(r: RequestView, num_layers: int) -> bool:
    return r.device_layers is not None and r.device_layers < num_layers


def _decodes_on_device(r: RequestView, num_layers: int) -> bool:
    """Whether it decodes from the device: every layer there, its prompt computed."""
    return decodes_next(r) and not _offloads(r, num_layers)


def _restore_whole(running: Sequence[RequestView], pool: PoolView, room: int) -> tuple[dict[str, int], dict[str, int], int]:
    """Restore mode: of the prefilled requests waiting for their offloaded layers, earliest scheduled
    first, those whose layers `room` holds all of, beside the next token's blocks of every decode and
    of theirs; the first that does not fit stops the rest (first come, first served), but takes the
    device layers of the waiting requests behind it when they make it fit, the latest scheduled first:
    they decode only once all of theirs are back, so until then those layers hold room the first
    could decode in. The restores, the layers those behind keep (none), and the blocks taken net."""
    layers = pool.num_layers

    def growth(r: RequestView, on_device: int) -> int:
        return on_device * (pool.blocks_for(r.num_tokens) - r.blocks_per_layer)

    room -= sum(growth(r, layers) for r in running if _decodes_on_device(r, layers))
    waiting = sorted((r for r in running if _offloads(r, layers) and decodes_next(r)),
                     key=lambda r: r.scheduled_at or r.arrival)
    restored, taken = {}, 0
    for i, r in enumerate(waiting):
        need = (layers - r.device_layers) * r.blocks_per_layer + growth(r, layers)
        if taken + need <= room:
            taken += need
            restored[r.request_id] = layers - r.device_layers
            continue
        emptied, freed = {}, 0
        for behind in reversed(waiting[i + 1:]):
            if taken + need <= room + freed:
                break
            if behind.device_layers:
                emptied[behind.request_id] = 0
                freed += behind.device_layers * behind.blocks_per_layer
        if taken + need > room + freed:
            return restored, {}, taken
        restored[r.request_id] = layers - r.device_layers
        return restored, emptied, taken + need - freed
    return restored, {}, taken


def _retain(inp: OffloadInput, slack: int) -> tuple[dict[str, int], int]:
    """Of each request about to be admitted, in order, the layers it keeps: all of them while
    `slack` (forecast room above the threshold) holds its prompt and a block a stage of the horizon
    on every layer; otherwise as many as the slack holds beside the two blocks per block of a layer
    its staging borrows, and at least x (Eq. 4): 3.1.1's x is the fewest layers kept, and 5.2.3
    keeps LayerKV's decodes near vLLM's throughput "by maximizing the number of layers retained".
    Without a profile every layer is kept (absent from the plan). And the slack left."""
    pool, retain = inp.pool, {}
    profiled = pool.prefill_cost is not None and pool.offload_cost is not None
    for r in inp.admitting:
        blocks = pool.blocks_for(r.num_tokens)
        per_layer = blocks + inp.params.horizon_stages
        keep = pool.num_layers
        if profiled and keep * per_layer > slack:
            seqlen = r.uncomputed_tokens
            least = retained_layers(seqlen, prefill_time_s(seqlen, pool.prefill_cost), pool.offload_cost)
            keep = max(least, min(pool.num_layers - 1, (slack - 2 * blocks) // per_layer))
        if profiled:
            retain[r.request_id] = keep
        slack -= keep * per_layer + (2 * blocks if keep < pool.num_layers else 0)
    return retain, slack


def _restore(running: Sequence[RequestView], num_layers: int, slack: int, horizon: int) -> dict[str, int]:
    """Offloaded layers the forecast has room to bring back, earliest scheduled request first, as
    many of each one's as fit: kept on the device until used, a retained layer is free prefetching
    (3.1.1), and a decode stops loading it each step. A layer back costs its blocks now and one more
    each stage of the horizon."""
    restored = {}
    offloaded = [r for r in running if r.device_layers is not None and r.device_layers < num_layers]
    for r in sorted(offloaded, key=lambda r: r.scheduled_at or r.arrival):
        layers = min(num_layers - r.device_layers, slack // (r.blocks_per_layer + horizon))
        if layers <= 0:
            break
        slack -= layers * (r.blocks_per_layer + horizon)
        restored[r.request_id] = layers
    return restored


def _shrink(running: Sequence[RequestView], num_layers: int, short: int) -> dict[str, int]:
    """Device layers each running request keeps, for those that give some up to cover `short` blocks."""
    def on_device(r: RequestView) -> int:
        return num_layers if r.device_layers is None else r.device_layers

    candidates = sorted((r for r in running if r.tier == "device" and r.blocks_per_layer and on_device(r)),
                        key=lambda r: r.arrival if r.scheduled_at is None else r.scheduled_at, reverse=True)
    keep = {r.request_id: on_device(r) for r in candidates}
    for cut in (lambda x: x // 2, lambda x: 0):
        for r in candidates:
            if short <= 0:
                break
            after = cut(keep[r.request_id])
            short -= r.blocks_per_layer * (keep[r.request_id] - after)
            keep[r.request_id] = after
    return {r.request_id: keep[r.request_id] for r in candidates if keep[r.request_id] < on_device(r)}
