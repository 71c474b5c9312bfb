"""Compiles and loads the C++ CPU kernels (csrc/: paged attention, and the elementwise steps of a
decoder layer) with torch's extension builder.

The build lives under the virtualenv (sys.prefix/torch_extensions/kvmesh_paged_attention, or
$KVMESH_EXT_DIR), so setup builds it once (`python -m kvmesh.services.engine.attention.build`)
and every later process only loads it; torch rebuilds it when the source, the flags or the CPU
change.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

NAME = "kvmesh_paged_attention"
CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "paged_attention.cpp", CSRC / "layer_ops.cpp"]


def build_directory() -> Path:
    return Path(os.environ.get("KVMESH_EXT_DIR") or Path(sys.prefix) / "torch_extensions" / NAME)


def cflags() -> list[str]:
    # -march=native ties the binary to this CPU; naming the CPU in a define makes torch's build
    # hash differ on another one (a copied virtualenv), so it rebuilds instead of crashing. torch
    # hashes the sources but not the headers they include, hence their own define.
    return ["-O3", "-march=native", "-fopenmp", f"-DKVMESH_CPU={_cpu_fingerprint()}",
            f"-DKVMESH_HEADERS={_headers_fingerprint()}"]


@functools.cache
def load_extension() -> ModuleType | None:
    """The compiled kernel module, building it if needed; None (logged) when it cannot be built."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        log.warning("paged attention: no C++ compiler (%s) on PATH; using the torch implementation", compiler)
        return None
    if not cpp_extension.is_ninja_available():
        log.warning("paged attention: ninja is not installed; using the torch implementation")
        return None
    directory = build_directory()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load(name=NAME, sources=[str(s) for s in SOURCES], extra_cflags=cflags(),
                                  extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False)
    except Exception as error:  # noqa: BLE001 - whatever failed, the torch implementation still works
        tail = "\n".join(str(error).splitlines()[-20:])  # the compiler's output can be long
        log.warning("paged attention: building the C++ kernel in %s failed; using the torch implementation:\n%s",
                    directory, tail)
        return None


def _cpu_fingerprint() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor() or platform.machine()
    return hashlib.sha256(flags.encode()).hexdigest()[:12]


def _headers_fingerprint() -> str:
    return hashlib.sha256(b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))).hexdigest()[:12]


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
