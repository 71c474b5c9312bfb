"""The engine's C++ CPU kernels (csrc/: paged attention, the elementwise steps of a decoder layer,
and whole-block copies between KV pools), built and loaded by kvmesh.libs.native; setup builds them
once with `python -m kvmesh.services.engine.native.attention.build`.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from types import ModuleType

from kvmesh.libs import native

NAME = "kvmesh_paged_attention"
CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "paged_attention.cpp", CSRC / "layer_ops.cpp", CSRC / "block_copy.cpp", CSRC / "quant_linear.cpp",
           CSRC / "quant_linear_bf16.cpp")


def load_extension() -> ModuleType | None:
    """The compiled kernel module, building it if needed; None (logged) when it cannot be built."""
    return native.load(NAME, SOURCES, openmp=True)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = time.monotonic()
    module = load_extension()
    if module is None:
        return 1
    print(f"paged attention kernel ready: {module.__file__} ({time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
