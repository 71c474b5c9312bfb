"""Runs a benchmark's `--quick --json` as a user would; the bench tests judge its contract, not its values."""

from __future__ import annotations

import math
import operator
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from kvmesh.bench.vllm_process import vllm_missing

# For each bench test module's `pytestmark`: each benchmark runs under its own subprocess timeout
# (up to 600 s: a slower CPU, say one without AVX-512, takes the cacheopt benchmark past the suite's
# 120 s default).
BENCH_TIMEOUT = pytest.mark.timeout(660)

COMPARISONS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}


def assert_contract(result: dict) -> None:
    """The contract's verdicts, judged again from the saved JSON: every target has a direction and a
    ratio (null where its measurement is missing: JSON has no NaN), and meets[k] is ratios[k] held
    against targets[k] in that direction, a missing ratio missing its target."""
    targets, directions, meets, ratios = result["targets"], result["directions"], result["meets"], result["ratios"]
    assert set(meets) == set(targets) == set(directions), "every target has a verdict and a direction"
    assert set(targets) <= set(ratios), f"targets without a ratio: {set(targets) - set(ratios)}"
    for key, target in targets.items():
        value = ratios[key]
        met = value is not None and not math.isnan(value) and COMPARISONS[directions[key]](value, target)
        assert meets[key] is met, f"{key}: {value} {directions[key]} {target} is {met}, reported {meets[key]}"


def skip_without_vllm() -> None:
    """Skips the calling test, saying why, where vLLM's virtualenv (.venv-vllm) does not run vLLM."""
    reason = vllm_missing()
    if reason:
        pytest.skip(f"needs vLLM: {reason}")


def quick_bench(tmp_path: Path, name: str, timeout: float, *args: str) -> tuple[dict, subprocess.CompletedProcess]:
    """`kvmesh bench NAME --quick --json [ARGS]`, run as a user would; its JSON and the run."""
    out = tmp_path / f"{name}.json"
    done = subprocess.run([sys.executable, "-m", "kvmesh", "bench", name, "--quick", "--json", str(out), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    result = msgspec.json.decode(out.read_bytes())
    assert result["bench"] == name and result["quick"] is True
    assert_contract(result)
    return result, done
