"""Policies of other packages: the `kvmesh.policies` entry-point group, entry name `KIND:NAME`."""

from __future__ import annotations

from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import TypeVar

T = TypeVar("T")


def names(kind: str, builtin: Mapping[str, object]) -> list[str]:
    """The built-in names, then those installed packages add for `kind`."""
    plugins = [e.name.partition(":")[2] for e in entry_points(group="kvmesh.policies") if e.name.startswith(f"{kind}:")]
    return [*builtin, *(n for n in plugins if n not in builtin)]


def resolve(kind: str, builtin: Mapping[str, T], name: str, what: str) -> T:
    """`builtin[name]`, else the installed package's `KIND:NAME`; KeyError naming the known ones."""
    if name in builtin:
        return builtin[name]
    for entry in entry_points(group="kvmesh.policies"):
        if entry.name == f"{kind}:{name}":
            return entry.load()
    raise KeyError(f"no {what} named {name!r}; known: {', '.join(builtin)}")
