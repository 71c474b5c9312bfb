"""LayerKV's decodes with `decode_offloaded` "restore" (section 4: the decode's KV moves from host
to device layer by layer): a prefilled request's offloaded layers all come back before it decodes,
earliest scheduled first, once the free device blocks hold them; as a pure function, exact values."""

from __future__ import annotations

from types import MappingProxyType

from kvmesh.policies.costs import OffloadCost, PrefillCost
from kvmesh.policies.offload import OffloadInput, OffloadParams, decodes_next, layerkv
from kvmesh.policies.views import PoolView, RequestView

PREFILL = PrefillCost(alpha=2.0, num_params=10**6, hidden_size=256, flops_per_s=1e9)
OFFLOAD = OffloadCost(beta=1.0, num_layers=4, head_dim=64, num_kv_heads=2, bytes_per_element=4,
                      bandwidth_bytes_per_s=1e9)


def view(request_id: str, prompt: int, generated: int, computed: int, **fields) -> RequestView:
    return RequestView(request_id=request_id, arrival=0.0, prompt_len=prompt, num_tokens=prompt + generated,
                       num_computed=computed, num_generated=generated, max_tokens=100,
                       predicted_output_median=90, tier="device", **fields)


# 16-token blocks, 4 layers. d decodes from the device (every layer), its 33rd token opening a third
# block a layer: 4 blocks of growth. a and b wait for their layers: a keeps 1 of 4 (3 blocks a layer,
# its 41st token still in the third), b none (4 blocks a layer, its 65th token opens a fifth). p is
# still prefilling, 2 layers offloaded: its staging borrows 2 x 2 blocks each step.
RUNNING = [view("d", 30, 3, 32, blocks_per_layer=2, scheduled_at=0.0),
           view("a", 40, 1, 40, blocks_per_layer=3, device_layers=1, scheduled_at=2.0),
           view("b", 64, 1, 64, blocks_per_layer=4, device_layers=0, scheduled_at=1.0),
           view("p", 100, 0, 32, blocks_per_layer=2, device_layers=2, scheduled_at=4.0)]


def plan(free: int, threshold: int = 10, admitting=()):
    pool = PoolView(block_size=16, num_layers=4, free=MappingProxyType({"device": free, "cxl": 1000}),
                    total=MappingProxyType({"device": 100, "cxl": 1000}), prefill_cost=PREFILL, offload_cost=OFFLOAD)
    return layerkv(OffloadInput(admitting=list(admitting), running=RUNNING, pool=pool, now=0.0,
                                params=OffloadParams(threshold, 3, decode_offloaded="restore")))


def test_a_decode_is_a_computed_prompt_and_a_sampled_token():
    assert [decodes_next(r) for r in RUNNING] == [True, True, True, False]


def test_prefilled_requests_get_all_their_layers_back_earliest_first_as_the_free_blocks_hold_them():
    # 100 free, less p's staging 4 and d's next block on each layer 4: 92. b first (scheduled at 1):
    # 4 layers x 4 blocks and its fifth block on each layer, 20; then a: 3 layers x 3 blocks, 9.
    assert plan(100).restore == {"b": 4, "a": 3}
    # 30 free: 22 hold b's 20, not a's 9 more
    assert plan(30).restore == {"b": 4}
    # 22 free: 14 do not hold b's 20, a (9) does not overtake it, and a's one device layer (3
    # blocks, idle until its other three are back) would not make b fit
    assert plan(22).restore == {}


def test_the_first_waiting_restore_takes_the_idle_device_layers_of_those_behind_it():
    # 26 free: 18 do not hold b's 20, but with a's device layer (3 blocks) given up they do (no
    # threshold: nothing else is shrunk)
    assert (plan(26, threshold=0).restore, plan(26, threshold=0).shrink) == ({"b": 4}, {"a": 0})


def test_the_threshold_does_not_hold_a_restore_back_and_a_shortfall_takes_only_idle_layers():
    # Eq. 5 takes 7 blocks a stage (d 4, a 1, p 2; b none): its low, 79, is 2 short of a threshold
    # of 81. b and a come back all the same (the free blocks hold them); halving p's device layers,
    # which no decode reads, covers the 2. d's, being read, are never taken.
    squeezed = plan(100, threshold=81)
    assert squeezed.restore == {"b": 4, "a": 3} and squeezed.shrink == {"p": 1}
    # With 30 free and a threshold of 95 (86 short), a stays waiting: its retained layer is idle
    # too, and goes after p's (newer) half; halving both is not enough: both go to none.
    tight = plan(30, threshold=95)
    assert tight.restore == {"b": 4} and tight.shrink == {"p": 0, "a": 0}


def test_restores_take_their_room_before_a_request_being_admitted():
    # threshold 10: Eq. 5 takes 7 blocks a stage (d 4, a 1, p 2; b none): its low 79, 69 above the
    # threshold, less p's staging 4 and the restores' 29: 36. w's 100 tokens on every layer take
    # 4 x (7 + 3) = 40: it keeps what fits beside its own staging's 2 x 7, (36 - 14) // 10 = 2 layers.
    assert plan(100, admitting=[view("w", 100, 0, 0, blocks_per_layer=0)]).retain == {"w": 2}
