"""`kvmesh bench sim_scale`: registered; its result keeps the contract, with a key per size, the runs
against single steps, the hour extrapolated and the peak memory; decode runs simulate what single
steps do. Tiny sizes and windows (the module's constants patched): no assertion on speed."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kvmesh.bench import sim_scale
from kvmesh.bench.runner import BENCHES, run_bench
from kvmesh.sim.cluster import MAX_RUN_STEPS

from .quick import assert_contract


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setattr(sim_scale, "ENGINES", (1, 2, 3))
    monkeypatch.setattr(sim_scale, "QUICK_WINDOWS_S", {1: 3.0, 2: 2.0, 3: 1.0})
    monkeypatch.setattr(sim_scale, "TARGETED", 2)
    monkeypatch.setattr(sim_scale, "PLOT", tmp_path / "sim_scale.png")
    return tmp_path


def test_registered() -> None:
    assert "sim_scale" in BENCHES


def test_quick_result_keeps_the_contract(tiny: Path) -> None:
    out = tiny / "sim_scale.json"
    assert run_bench("sim_scale", quick=True, json_path=out) == 0
    result = msgspec.json.decode(out.read_bytes())
    assert_contract(result)
    ratios = result["ratios"]
    assert result["targets"] == {"sim_per_wall_2": 100.0, "runs_identical_1": 1.0, "runs_identical_2": 1.0,
                                 "runs_identical_3": 1.0}
    for n in (1, 2, 3):
        assert ratios[f"sim_per_wall_{n}"] > 0 and ratios[f"sim_per_wall_{n}_drained"] > 0
        assert ratios[f"runs_speedup_{n}"] > 0
        assert ratios[f"runs_identical_{n}"] == 1.0
    assert ratios["hour_wall_s_2"] == pytest.approx(3600 / ratios["sim_per_wall_2"])
    assert ratios["peak_rss_mb"] > 0
    assert [(row["compared"], row["path"]) for row in result["rows"]] == [
        (label, f"colocated:{n}, {window:.0f} s")
        for n, window in ((1, 3.0), (2, 2.0), (3, 1.0))
        for label in (f"runs of <= {MAX_RUN_STEPS}", "single steps")]
    assert set(result["rows"][0]["cells"]) >= {"sim s", "wall s", "sim/wall", "requests", "steps"}
    assert Path(result["plots"][0]).is_file()


def test_runs_simulate_what_single_steps_do() -> None:
    """At a load where decode runs are taken and cut: the same figures, the same steps, and the arrival
    window ends at the last arrival."""
    runs, single = sim_scale.simulate(2, 5.0, MAX_RUN_STEPS), sim_scale.simulate(2, 5.0, 0)
    assert runs.summary == single.summary and runs.steps == single.steps
    assert runs.summary["requests"] == round(sim_scale.RATE_PER_ENGINE * 2 * 5.0)
    assert runs.last_arrival_s == max(r.arrival for r in sim_scale.workload(2, 5.0))
    assert 0 < runs.window_wall_s <= runs.wall_s and runs.last_arrival_s <= runs.sim_s
    assert runs.summary["unfinished"] == 0
