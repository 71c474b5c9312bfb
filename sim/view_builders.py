"""The routing views the simulator builds at every route and heartbeat (EngineLoad, EngineView), made
slot by slot: a frozen dataclass's __init__ sets each field through object.__setattr__, which checks
the type's bases every time (a twentieth of a 64-engine cluster's instructions). Speed only: the
objects are the ones the dataclasses make."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields

from kvmesh.policies.routing.views import EngineLoad, EngineView


def slot_builder(cls: type) -> Callable:
    """A function that makes the frozen slots dataclass `cls` from all its fields, positionally: the
    object `cls(...)` makes, each slot set through its own descriptor rather than object.__setattr__
    (the frozen __init__'s way, which checks the type's bases for every field), at about half the cost.
    Generated as dataclasses generates an __init__. For callers that build one at every route."""
    names = [f.name for f in fields(cls)]
    scope = {"new": object.__new__, "cls": cls} | {f"set_{name}": getattr(cls, name).__set__ for name in names}
    body = "".join(f"    set_{name}(made, {name})\n" for name in names)
    exec(f"def build({', '.join(names)}):\n    made = new(cls)\n{body}    return made\n", scope)
    return scope["build"]


build_load, build_view = slot_builder(EngineLoad), slot_builder(EngineView)
