"""How long a step lasts with LayerKV's staged layers: the layers whose KV is in the cxl tier are
computed in a staging area of device blocks, their context loaded before the layer's attention and
the blocks the step wrote written back after it, on one side stream that overlaps the compute
(services/engine/native/layer_staging.py, as on a GPU).

The model: the step's compute T is spread evenly over its L layers, t = T / L each. Copies run one
after another on the side stream, each starting when it is issued and the stream is free. At a
staged layer the compute waits for the layer's load (the first staged layer issues its own load
then; each later one was issued at the staged layer before it), issues the next staged layer's load,
computes the layer, and issues the layer's write-back. The step ends when both the compute and the
stream are done. So each layer takes max(compute of the layer, copy of the next): with every layer
staged, equal loads l and writes w,

    step = T + l + w          when l + w <= t  (the copies hide but the first load and the last write)
    step = L (l + w)          when t <= l and t <= w  (copy-bound: the stream never rests)

and with no staged layer the step is T."""

from __future__ import annotations

from collections.abc import Mapping


def staged_step_s(compute_s: float, num_layers: int, copies: Mapping[int, tuple[float, float]]) -> float:
    """The step's time: `compute_s` over `num_layers` layers, with `copies` the staged layers' (load
    seconds, write-back seconds)."""
    if not copies:
        return compute_s
    per_layer = compute_s / num_layers
    order = sorted(copies)
    clock = stream = 0.0  # where the compute is; when the side stream is free
    loaded = None         # when the load of the next staged layer is done
    reached = 0           # layers computed so far
    for k, layer in enumerate(order):
        clock += (layer - reached) * per_layer
        if loaded is None:  # the first staged layer issues its own load, on an idle stream
            loaded = stream = clock + copies[layer][0]
        clock = max(clock, loaded)
        if k + 1 < len(order):  # the next staged layer's load, into the area's other half
            loaded = stream = max(clock, stream) + copies[order[k + 1]][0]
        clock += per_layer
        stream = max(clock, stream) + copies[layer][1]
        reached = layer + 1
    clock += (num_layers - reached) * per_layer
    return max(clock, stream)
