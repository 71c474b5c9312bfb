"""The Grafana dashboards (observability/dashboards): each one is a dashboard Grafana imports anywhere
(panels with Prometheus targets through a `datasource` variable, never a fixed data source), and
every series its PromQL reads is one a kvmesh service exports: the names are collected from the
services' own registries, built in-process. Every series of the predictor is charted. And the local
Prometheus config scrapes `kvmesh up`."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from kvmesh.services.admission import app as admission
from kvmesh.services.engine import app as engine
from kvmesh.services.kvmeta import app as kvmeta
from kvmesh.services.predictor import app as predictor
from kvmesh.services.predictor import learning
from kvmesh.services.scheduler import app as scheduler

OBSERVABILITY = Path(__file__).parents[2] / "observability"
DASHBOARDS = sorted((OBSERVABILITY / "dashboards").glob("*.json"))
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SAMPLE_SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "summary": ("_sum", "_count", "_created"),
                   "histogram": ("_bucket", "_sum", "_count", "_created")}
METRIC = re.compile(r"\bkvmesh_[a-z0-9_]+")


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def targets(board: dict) -> list[tuple[str, dict]]:
    return [(panel["title"], target) for panel in board["panels"] if panel["type"] != "row"
            for target in panel["targets"]]


def families(service) -> set[tuple[str, str]]:
    return {(family.name, family.type) for family in service.metrics.collect()}


@pytest.fixture(scope="module")
def predictor_families(tmp_path_factory: pytest.TempPathFactory) -> set[tuple[str, str]]:
    """The predictor's metric families when it serves a model, as it exports the most then: loading
    one (torch and the encoder) is stood in for by a predictor that keeps no examples."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(learning, "load", lambda *args: SimpleNamespace(examples=0))
        config = predictor.Config(model_path=str(tmp_path_factory.mktemp("model")))
        return families(predictor.build_service(config))


@pytest.fixture(scope="module")
def exported(predictor_families: set[tuple[str, str]]) -> set[str]:
    """Every sample name the services can serve on /metrics."""
    services = [admission.build_service(admission.Config()), scheduler.build_service(scheduler.Config()),
                kvmeta.build_service(kvmeta.Config()), engine.build_service(engine.Config(dataplane="none"))]
    every = predictor_families.union(*map(families, services))
    return {name + suffix for name, kind in every for suffix in SAMPLE_SUFFIXES[kind]}


def test_there_is_a_dashboard_for_each_view():
    assert {load(path)["uid"] for path in DASHBOARDS} == {"kvmesh-requests", "kvmesh-slos", "kvmesh-kv-memory",
                                                          "kvmesh-transfer", "kvmesh-cache"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_a_dashboard_has_a_prometheus_datasource_variable_and_uses_only_it(path: Path):
    board = load(path)
    assert board["title"] and isinstance(board["schemaVersion"], int) and board["panels"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert all(panel["datasource"] == DATASOURCE for panel in board["panels"])
    assert all(target["datasource"] == DATASOURCE for _, target in targets(board))


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_a_dashboard_panels_are_laid_out_on_the_grid_without_overlapping(path: Path):
    panels = load(path)["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    boxes = []
    for panel in panels:
        grid = panel["gridPos"]
        if panel["type"] == "row":  # a heading across the board; its panels follow it, not nested
            assert panel["title"] and (grid["x"], grid["w"], grid["h"]) == (0, 24, 1)
            assert panel["collapsed"] is False and panel["panels"] == []
        else:
            assert panel["type"] in ("timeseries", "bargauge") and panel["title"] and panel["targets"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= 24
        boxes.append((grid["x"], grid["y"], grid["x"] + grid["w"], grid["y"] + grid["h"]))
    for a, b in itertools.combinations(boxes, 2):
        assert a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1], f"panels at {a} and {b} overlap"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_target_is_a_promql_query_of_kvmesh_series(path: Path):
    for title, target in targets(load(path)):
        expr = target["expr"]
        assert METRIC.search(expr), f"{title}: {expr} reads no kvmesh series"
        for opening, closing in ("()", "{}", "[]"):
            assert expr.count(opening) == expr.count(closing), f"{title}: unbalanced {opening}{closing} in {expr}"
    refs = [[target["refId"] for target in panel.get("targets", [])] for panel in load(path)["panels"]]
    assert all(len(set(ids)) == len(ids) for ids in refs)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_series_a_dashboard_reads_is_exported_by_a_service(path: Path, exported: set[str]):
    read = {name for _, target in targets(load(path)) for name in METRIC.findall(target["expr"])}
    assert read - exported == set()


def test_every_series_of_the_predictor_and_the_kv_allocations_is_charted(predictor_families: set[tuple[str, str]]):
    read = {name for path in DASHBOARDS for _, target in targets(load(path)) for name in METRIC.findall(target["expr"])}
    charted = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in read}
    wanted = {name for name, _ in predictor_families if name.startswith("kvmesh_predictor_")}
    assert len(wanted) == 8  # predictions, observations, abs error, under, over, arrival rate, refits, examples
    assert wanted | {"kvmesh_engine_kv_allocations_grown", "kvmesh_engine_preemptions"} <= charted


def test_the_prometheus_config_scrapes_every_service_at_its_kvmesh_up_port():
    config = yaml.safe_load((OBSERVABILITY / "prometheus.yml").read_text())
    ports = {job["job_name"]: {int(t.rsplit(":", 1)[1]) for c in job["static_configs"] for t in c["targets"]}
             for job in config["scrape_configs"]}
    assert ports["kvmesh-admission"] == {admission.Config().port}
    assert ports["kvmesh-predictor"] == {predictor.Config().port}
    assert ports["kvmesh-scheduler"] == {scheduler.Config().port}
    assert ports["kvmesh-kvmeta"] == {kvmeta.Config().port}
    first = engine.Config().port
    assert set(range(first, first + 2)) <= ports["kvmesh-engine"]  # kvmesh up's default prefill and decode
