"""Which engines the local cluster runs: N prefill + M decode engines (1P1D by default), or one
colocated engine. `kvmesh scale` changes it while the cluster serves: it writes the wanted
topology into the run directory and signals the launcher, which starts or stops engines to match.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

import msgspec

from .state import pid_alive, read_state


class Topology(msgspec.Struct, kw_only=True, frozen=True):
    prefill: int = 1
    decode: int = 1
    colocated: int = 0

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.colocated) < 0:
            raise ValueError("engine counts must not be negative")
        if self.colocated == 0 and (self.prefill == 0) != (self.decode == 0):
            raise ValueError("a disaggregated cluster needs prefill and decode engines both, or neither")
        if self.colocated + self.prefill + self.decode == 0:
            raise ValueError("the cluster needs at least one engine")

    def engines(self) -> list[EngineSpec]:
        return ([EngineSpec(f"engine-p{i}", "prefill") for i in range(self.prefill)]
                + [EngineSpec(f"engine-d{i}", "decode") for i in range(self.decode)]
                + [EngineSpec(f"engine-c{i}", "both") for i in range(self.colocated)])


@dataclass(frozen=True)
class EngineSpec:
    name: str  # also the engine's id in the registry
    role: str


def wanted_path(run_dir: Path) -> Path:
    return run_dir / "topology.json"


def read_wanted(run_dir: Path) -> Topology | None:
    try:
        return msgspec.json.decode(wanted_path(run_dir).read_bytes(), type=Topology)
    except (OSError, msgspec.DecodeError, ValueError):
        return None


def write_wanted(run_dir: Path, topology: Topology) -> None:
    tmp = wanted_path(run_dir).with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.encode(topology))
    tmp.replace(wanted_path(run_dir))


def scale(run_dir: Path, prefill: int | None, decode: int | None, colocated: int | None) -> int:
    """`kvmesh scale`: ask the running launcher for a new topology; returns an exit code."""
    state = read_state(run_dir)
    current = read_wanted(run_dir)
    if state is None or current is None or not pid_alive(state.launcher_pid):
        print(f"kvmesh scale: no cluster runs from {run_dir}")
        return 1
    try:
        wanted = Topology(prefill=current.prefill if prefill is None else prefill,
                          decode=current.decode if decode is None else decode,
                          colocated=current.colocated if colocated is None else colocated)
    except ValueError as exc:
        print(f"kvmesh scale: {exc}")
        return 2
    write_wanted(run_dir, wanted)
    os.kill(state.launcher_pid, signal.SIGHUP)
    print(f"kvmesh scale: asked for {wanted.prefill} prefill, {wanted.decode} decode, {wanted.colocated} colocated")
    return 0
