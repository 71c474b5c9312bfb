"""The views' slot builders (sim/view_builders.py) make the object the dataclass makes: equal,
frozen, hashable alike, from all its fields in order, and no other count of them."""

from __future__ import annotations

import dataclasses

import pytest

from kvmesh.policies.routing.views import EngineLoad, EngineView, RouteDecision
from kvmesh.sim.view_builders import build_load, build_view, slot_builder


def test_a_built_view_is_the_view_its_dataclass_makes_and_as_frozen():
    load, made = build_load(7, 40, 2, 3), EngineLoad(7, 40, 2, 3)
    view = build_view("e1", "both", "m", load, 16, 4, 1, (16, 2))
    assert type(load) is EngineLoad and load == made and hash(load) == hash(made) and load.used_fraction == 1 - 7 / 40
    assert view == EngineView("e1", "both", "m", made, 16, 4, 1, (16, 2)) and view.cached_cxl_blocks == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.load = made
    assert dataclasses.replace(view, cached_blocks=0).cached_blocks == 0


def test_a_builder_takes_every_field_and_no_more():
    build = slot_builder(RouteDecision)
    assert build("p", "d", None, 2) == RouteDecision(prefill="p", decode="d", cached_blocks=2)
    with pytest.raises(TypeError):
        build("p", "d")
    with pytest.raises(TypeError):
        build_load(1, 2, 3, 4, 5)
