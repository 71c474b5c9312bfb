"""The benchmark contract's verdicts (bench/report.py): each target is judged once, in its stated
direction, and a target whose measurement is missing is reported as missed, never dropped."""

from __future__ import annotations

import math

import msgspec
import pytest

from kvmesh.bench.report import BenchResult, judge

from .quick import assert_contract


def result(ratios: dict[str, float], targets: dict[str, float], directions: dict[str, str] | None = None) -> BenchResult:
    return BenchResult(bench="x", quick=True, ratios=ratios, targets=targets, directions=directions or {},
                       ceilings={}, config={}, rows=[], headline="")


def test_a_target_is_a_floor_unless_its_direction_says_otherwise():
    ratios = {"speedup": 1.2, "overhead": 0.05, "strict": 1.0}
    targets = {"speedup": 1.2, "overhead": 0.03, "strict": 1.0}
    assert judge(ratios, targets, {"overhead": "<=", "strict": ">"}) == {
        "speedup": True, "overhead": False, "strict": False}
    assert judge({"overhead": 0.03}, {"overhead": 0.03}, {"overhead": "<="}) == {"overhead": True}
    assert judge({"x": 2.0}, {"x": 3.0}, {"x": "<"}) == {"x": True}


def test_a_missing_or_nan_measurement_misses_its_target_in_either_direction():
    assert judge({}, {"speedup": 1.0}, {}) == {"speedup": False}
    assert judge({"overhead": math.nan}, {"overhead": 0.03}, {"overhead": "<="}) == {"overhead": False}


def test_the_result_judges_its_own_targets_and_keeps_a_missing_one_as_nan():
    made = result({"speedup": 1.5, "information": 7.0}, {"speedup": 1.2, "overhead": 0.03}, {"overhead": "<="})
    assert made.directions == {"speedup": ">=", "overhead": "<="}
    assert math.isnan(made.ratios["overhead"]) and made.ratios["information"] == 7.0
    assert made.meets == {"speedup": True, "overhead": False}
    # As saved and read back (NaN becomes null in JSON), the contract check agrees.
    assert_contract(msgspec.json.decode(msgspec.json.encode(made)))


def test_a_direction_for_no_target_or_of_no_known_kind_is_refused():
    with pytest.raises(ValueError, match="directions"):
        result({"speedup": 1.0}, {"speedup": 1.0}, {"speedup": "=>"})
    with pytest.raises(ValueError, match="directions"):
        result({"speedup": 1.0}, {"speedup": 1.0}, {"latency": "<="})


def test_the_contract_check_catches_a_verdict_that_disagrees_with_its_ratio():
    saved = msgspec.json.decode(msgspec.json.encode(result({"speedup": 0.9}, {"speedup": 1.2})))
    saved["meets"]["speedup"] = True
    with pytest.raises(AssertionError, match="speedup"):
        assert_contract(saved)
    del saved["directions"]["speedup"]
    with pytest.raises(AssertionError, match="direction"):
        assert_contract(saved)


def test_every_result_names_the_cpu_it_was_measured_on():
    """Sessions run on different machines (AMX or not changes bf16 figures 2x), so each saved result
    says which CPU, how many cores it could use, and the instructions its kernels choose between."""
    made = msgspec.json.decode(msgspec.json.encode(result({}, {})))
    machine = made["machine"]
    assert machine["cpu"] and machine["cores"] >= 1
    assert set(machine["instructions"]) <= {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
    with open("/proc/cpuinfo") as cpuinfo:
        flags = next(line for line in cpuinfo if line.startswith("flags")).split()
    assert ("amx_tile" in machine["instructions"]) == ("amx_tile" in flags)
    assert ("avx512_bf16" in machine["instructions"]) == ("avx512_bf16" in flags)
