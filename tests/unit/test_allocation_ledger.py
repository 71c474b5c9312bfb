"""CacheOpt 3.3's allocation ledger (policies/allocation/ledger.py) on exact numbers: 20 free device
blocks a layer, blocks of 16 tokens, B = 8 tokens, a global reservation of 2 blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.policies.allocation import AllocationParams, Grant
from kvmesh.policies.allocation.ledger import Ledger


@dataclass
class Held:
    request_id: str
    num_tokens: int
    blocks_per_layer: int
    allocation: int | None = None
    tier: str = "device"
    passes: list[tuple[str, int]] = field(default_factory=list)
    guests: list[str] = field(default_factory=list)


def ledger(*holders: Held, free: int = 20) -> Ledger:
    return Ledger(AllocationParams(block_tokens=8, reserved_blocks=2), 16, lambda: free, lambda: holders)


def test_headroom_leaves_out_what_allocations_promise_and_the_reservation():
    a, b = Held("a", 32, 2, allocation=64), Held("b", 16, 1)
    books = ledger(a, b)
    assert books.promised(a, 64) == 2                    # 4 blocks for 64 tokens, 2 held
    assert books.headroom() == 18
    assert books.unallocated_tokens() == (18 - 2) * 16   # A'_kvc


def test_a_grant_the_unallocated_kv_cannot_cover_changes_nothing():
    a, b = Held("a", 32, 2, allocation=64), Held("b", 16, 1)
    books = ledger(a, b)
    assert books.allot(b, Grant("b", 100)) and b.allocation == 100   # 6 blocks more: 96 of 256 tokens
    assert not books.allot(b, Grant("b", 500)) and b.allocation == 100


def test_growth_comes_from_the_unallocated_then_the_reservation_then_others_unused_allotments():
    a, b = Held("a", 65, 2, allocation=64), Held("b", 16, 1, allocation=272)   # b promises 16 blocks
    books = ledger(a, b)
    assert books.unallocated_tokens() == 0 and books.headroom() == 2
    assert books.grow(a, 81) and a.allocation == 88      # 64 + 24 (B at a time): 2 blocks more, the reservation's
    assert books.grown == {"unallocated": 0, "reserved": 1, "reclaimed": 0} and books.headroom() == 0
    assert books.grow(a, 97) and a.allocation == 104     # nothing free: b gives back its unused allotment
    assert b.allocation == 16 + 8                        # b keeps B tokens ahead of what it has
    assert books.grown == {"unallocated": 0, "reserved": 1, "reclaimed": 1}
    assert books.headroom() == 20 - 5 - 1
    assert books.grow(a, 105) and books.grown["unallocated"] == 1


def test_an_embedded_guest_hands_its_hosts_kv_back_when_it_settles():
    host, guest = Held("host", 32, 2, allocation=128), Held("guest", 8, 1)
    books = ledger(host, guest)
    assert books.allot(guest, Grant("guest", 40, hosts=(("host", 40),)))
    assert (host.allocation, host.guests, guest.passes) == (88, ["guest"], [("host", 40)])
    books.settle(guest)
    assert (host.allocation, guest.allocation, guest.passes) == (128, None, [])
