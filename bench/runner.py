"""`kvmesh bench NAME [--quick] [--json PATH]`: run one benchmark, print its table, save its JSON."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from .report import save, show

BENCHES = ("kvmeta", "engine", "transfer")


def run_bench(name: str, *, quick: bool, json_path: Path | None) -> int:
    if name not in BENCHES:
        print(f"kvmesh bench: no benchmark {name!r}; there are: {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    result = importlib.import_module(f"kvmesh.bench.{name}").run(quick=quick)
    show(result)
    if json_path is not None:
        save(result, json_path)
    return 0
