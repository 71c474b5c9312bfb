"""`kvmesh report`: span files written by hand (docs/observability.md's schema) turned into the KVDirect
Fig. 14 breakdown, percentiles, span trees, PNGs and JSON."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from kvmesh.cli import main
from kvmesh.observability.report import (
    Incomplete,
    RequestRow,
    aggregates,
    breakdown_row,
    build_report,
    group_traces,
    print_report,
    read_spans,
    span_tree,
)

T0 = 1_763_790_000_000_000_000  # ns
_ids = iter(range(1, 10_000))


def span(trace: str, name: str, service: str, start_ms: float, end_ms: float, parent: dict | None = None,
         attributes: dict | None = None, kind: str = "INTERNAL", status: str = "OK", **extra) -> dict:
    return {"trace_id": trace, "span_id": f"{next(_ids):016x}", "parent_id": parent["span_id"] if parent else None,
            "name": name, "service": service, "kind": kind, "start_ns": T0 + round(start_ms * 1e6),
            "end_ns": T0 + round(end_ms * 1e6), "status": status, "status_message": None,
            "attributes": attributes or {}, "events": [], **extra}


def admission(trace: str, request_id: str, mode: str, start: float, e2e: float, ttft: float, tbt: list[float],
              **extra) -> dict:
    return span(trace, "admission", "admission", start, start + e2e, kind="SERVER", **extra, attributes={
        "kvmesh.request_id": request_id, "kvmesh.transfer_mode": mode, "kvmesh.ttft_ms": ttft,
        "kvmesh.e2e_ms": e2e, "kvmesh.tbt_ms": tbt, "kvmesh.finish_reason": "length"})


def colocated_trace(trace: str = "a" * 32) -> list[dict]:
    """At 0 ms: prefill queue 5, prefill 18, decode 69; 100 ms end to end."""
    root = admission(trace, "req-colo", "colocated", 0, 100, ttft=30, tbt=[5, 7, 9])
    route = span(trace, "route", "admission", 1, 3, root, kind="CLIENT")
    prefill = span(trace, "prefill", "admission", 4, 99, root, kind="CLIENT")
    server = span(trace, "POST /v1/generate", "engine-c0", 5, 98, prefill, kind="SERVER")
    return [root, route, span(trace, "POST /v1/route", "scheduler", 1.5, 2.5, route, kind="SERVER"), prefill, server,
            span(trace, "prefill.queue", "engine-c0", 5, 10, server),
            span(trace, "prefill.compute", "engine-c0", 10, 28, server),
            span(trace, "decode.compute", "engine-c0", 28, 97, server)]


def pull_trace(trace: str, request_id: str, start: float, e2e: float, transfer: float, tbt: list[float]) -> list[dict]:
    """Prefill queue 8, prefill 25, decode queue 8 (37 -> 45), `transfer`, decode from its end to e2e - 3."""
    at = lambda ms: start + ms  # noqa: E731
    root = admission(trace, request_id, "pull", start, e2e, ttft=40, tbt=tbt)
    route = span(trace, "route", "admission", at(1), at(3), root, kind="CLIENT")
    prefill = span(trace, "prefill", "admission", at(3), at(40), root, kind="CLIENT")
    p_server = span(trace, "POST /v1/generate", "engine-p0", at(4), at(39), prefill, kind="SERVER")
    decode = span(trace, "decode", "admission", at(41), at(e2e - 1), root, kind="CLIENT")
    d_server = span(trace, "POST /v1/generate", "engine-d0", at(42), at(e2e - 2), decode, kind="SERVER")
    pull = span(trace, "kv.transfer", "engine-d0", at(45), at(45 + transfer), d_server, attributes={
        "kvmesh.request_id": request_id, "kvmesh.bytes": 1048576, "kvmesh.pieces": 64, "kvmesh.reads_posted": 3,
        "kvmesh.backend": "tcp", "kvmesh.gbps": 0.0874})
    return [root, route, span(trace, "POST /v1/route", "scheduler", at(1.5), at(2.5), route, kind="SERVER"),
            prefill, p_server, span(trace, "prefill.queue", "engine-p0", at(4), at(12), p_server),
            span(trace, "prefill.compute", "engine-p0", at(12), at(37), p_server),
            decode, d_server, span(trace, "decode.queue", "engine-d0", at(42), at(45), d_server), pull,
            span(trace, "POST /v1/blocks/{request_id}", "kvmeta", at(46), at(47), pull, kind="SERVER"),
            span(trace, "decode.compute", "engine-d0", at(45 + transfer), at(e2e - 3), d_server)]


def aborted_trace(trace: str = "c" * 32) -> list[dict]:
    root = admission(trace, "req-abort", "pull", 500, 20, ttft=0, tbt=[], status="ERROR",
                     status_message="the client went away")
    root["attributes"]["kvmesh.finish_reason"] = "abort"
    queue = span(trace, "prefill.queue", "engine-p0", 501, 519, root, status="ERROR",
                 status_message="the client went away")
    queue["events"] = [{"name": "abort", "time_ns": queue["end_ns"], "attributes": {"reason": "client"}}]
    return [root, queue]


def write_spans(path: Path, spans: list[dict], truncated_tail: bool = False) -> Path:
    lines = [json.dumps(s) for s in spans]
    if truncated_tail:
        lines.append(lines[-1][: len(lines[-1]) // 2])  # a service killed mid-write
    path.write_text("\n".join(lines) + ("" if truncated_tail else "\n"))
    return path


def mixed_file(tmp_path: Path) -> Path:
    """Four requests (colocated, two pulls, an abort), an engine-only trace, and a truncated last line,
    interleaved as several services appending to one file would leave them."""
    spans = (colocated_trace() + pull_trace("b" * 32, "req-pull", 1000, 200, transfer=12, tbt=[4, 6])
             + pull_trace("d" * 32, "req-pull-2", 2000, 300, transfer=20, tbt=[5, 7]) + aborted_trace()
             + [span("e" * 32, "prefill.queue", "engine-p0", 3000, 3004)])
    return write_spans(tmp_path / "spans.jsonl", sorted(spans, key=lambda s: s["end_ns"]), truncated_tail=True)


def rows_by_request(path: Path) -> dict[str, RequestRow | Incomplete]:
    spans, _ = read_spans(path)
    results = [breakdown_row(trace_id, trace) for trace_id, trace in group_traces(spans).items()]
    return {r.request_id or r.trace_id: r for r in results}


def test_colocated_request_has_no_transfer_and_no_decode_queue(tmp_path: Path):
    row = rows_by_request(write_spans(tmp_path / "s.jsonl", colocated_trace()))["req-colo"]
    assert row.mode == "colocated"
    assert row.components == {"prefill_queue": 5.0, "prefill": 18.0, "transfer": 0.0, "decode_queue": 0.0,
                              "decode": 69.0}
    assert (row.e2e_ms, row.ttft_ms, row.tbt_ms) == (100.0, 30.0, [5.0, 7.0, 9.0])


def test_pull_request_queues_for_decode_from_first_token_to_the_transfer(tmp_path: Path):
    row = rows_by_request(write_spans(tmp_path / "s.jsonl", pull_trace("b" * 32, "req-pull", 1000, 200, 12, [4, 6])))
    assert row["req-pull"].components == {"prefill_queue": 8.0, "prefill": 25.0, "decode_queue": 8.0,
                                          "transfer": 12.0, "decode": 140.0}


def test_push_request_counts_the_block_reservation_as_prefill_queueing(tmp_path: Path):
    spans = [s for s in pull_trace("f" * 32, "req-push", 0, 200, 12, [4]) if s["name"] != "kv.transfer"]
    root = spans[0]
    root["attributes"]["kvmesh.transfer_mode"] = "push"
    spans.append(span("f" * 32, "POST /v1/kv/reserve", "engine-d0", 0.5, 2.5, root, kind="SERVER"))
    row = rows_by_request(write_spans(tmp_path / "s.jsonl", spans))["req-push"]
    assert row.components == {"prefill_queue": 10.0, "prefill": 25.0, "decode_queue": 20.0, "transfer": 0.0,
                              "decode": 140.0}  # decode queue: first token (37) -> decode starts (57)


def test_a_retried_phase_counts_the_attempt_that_served(tmp_path: Path):
    spans = colocated_trace()
    failed = span("a" * 32, "prefill.compute", "engine-c1", 2, 40, spans[0], status="ERROR", status_message="died")
    row = rows_by_request(write_spans(tmp_path / "s.jsonl", [*spans, failed]))["req-colo"]
    assert row.components["prefill"] == 18.0


def test_aborted_and_admissionless_traces_are_incomplete_not_errors(tmp_path: Path):
    rows = rows_by_request(mixed_file(tmp_path))
    assert rows["req-abort"] == Incomplete(trace_id="c" * 32, request_id="req-abort",
                                           reason="abort: the client went away")
    assert rows["e" * 32].reason == "no admission span"
    missing = [s for s in colocated_trace() if s["name"] != "decode.compute"]
    assert rows_by_request(write_spans(tmp_path / "m.jsonl", missing))["req-colo"].reason == "no decode.compute span"


def test_a_truncated_last_line_is_skipped_and_counted(tmp_path: Path):
    path = mixed_file(tmp_path)
    spans, skipped = read_spans(path)
    assert len(spans) == 8 + 13 + 13 + 2 + 1 and skipped == [len(spans) + 1]


def test_aggregates_per_mode(tmp_path: Path):
    report = build_report(mixed_file(tmp_path))
    assert [r.request_id for r in report.rows] == ["req-colo", "req-pull", "req-pull-2"]
    pull = report.aggregates["pull"]
    assert pull["e2e_ms"] == pytest.approx({"p50": 250.0, "p90": 290.0, "p99": 299.0, "mean": 250.0})
    assert pull["transfer"] == pytest.approx({"p50": 16.0, "p90": 19.2, "p99": 19.92, "mean": 16.0})
    assert pull["decode"] == pytest.approx({"p50": 186.0, "p90": 222.8, "p99": 231.08, "mean": 186.0})
    assert pull["tbt_ms"]["p50"] == pytest.approx(5.5)  # every gap of both requests: 4, 5, 6, 7
    assert aggregates(report.rows)["colocated"]["prefill"] == {"p50": 18.0, "p90": 18.0, "p99": 18.0, "mean": 18.0}


def test_span_tree_nests_children_under_their_parents(tmp_path: Path):
    spans, _ = read_spans(write_spans(tmp_path / "s.jsonl", pull_trace("b" * 32, "req-pull", 0, 200, 12, [4])))
    assert [branch + s.name for branch, s in span_tree(spans)] == [
        "admission",
        "├── route",
        "│   └── POST /v1/route",
        "├── prefill",
        "│   └── POST /v1/generate",
        "│       ├── prefill.queue",
        "│       └── prefill.compute",
        "└── decode",
        "    └── POST /v1/generate",
        "        ├── decode.queue",
        "        ├── kv.transfer",
        "        │   └── POST /v1/blocks/{request_id}",
        "        └── decode.compute",
    ]


def test_slowest_request_is_printed_as_a_tree_with_transfer_attributes(tmp_path: Path):
    output = io.StringIO()
    print_report(build_report(mixed_file(tmp_path)), Console(file=output, width=200), slowest=1)
    text = output.getvalue()
    assert "req-pull-2: pull, 300.0 ms end to end" in text and "req-pull: pull, 200.0" not in text
    tree = text[text.index("req-pull-2: pull"):]
    assert tree.index("└── decode") < tree.index("    └── POST /v1/generate") < tree.index("├── kv.transfer")
    assert "bytes=1048576" in tree and "reads_posted=3" in tree and "gbps=0.0874" in tree
    incomplete = f"2 incomplete: req-abort (abort: the client went away), {'e' * 32} (no admission span)"
    assert incomplete in text
    assert "1 unreadable lines skipped" in text


def test_kvmesh_report_prints_tables_and_writes_pngs_and_json(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    trace_file, out, json_path = mixed_file(tmp_path), tmp_path / "plots", tmp_path / "report.json"
    assert main(["report", str(trace_file), "--out", str(out), "--json", str(json_path), "--slowest", "2"]) == 0
    printed = capsys.readouterr().out
    assert "requests (ms)" in printed and "req-colo" in printed and "pull: 2 requests (ms)" in printed
    assert "req-pull-2: pull" in printed and "req-pull: pull" in printed and "req-colo: colocated" not in printed
    for png in ("breakdown.png", "latency_cdf.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads(json_path.read_text())
    assert [r["request_id"] for r in saved["requests"]] == ["req-colo", "req-pull", "req-pull-2"]
    assert saved["requests"][1]["components"]["transfer"] == 12.0
    assert saved["aggregates"]["pull"]["e2e_ms"]["p50"] == 250.0
    assert len(saved["incomplete"]) == 2 and saved["skipped_lines"] == [38]


def test_plots_go_next_to_the_trace_file_by_default(tmp_path: Path):
    assert main(["report", str(write_spans(tmp_path / "s.jsonl", colocated_trace()))]) == 0
    assert (tmp_path / "breakdown.png").exists() and (tmp_path / "latency_cdf.png").exists()


@pytest.mark.parametrize("content", [None, "", "{\"trace_id\": \"trun"])
def test_a_missing_or_empty_file_is_a_clear_error(tmp_path: Path, capsys, content: str | None):
    path = tmp_path / "spans.jsonl"
    if content is not None:
        path.write_text(content)
    assert main(["report", str(path)]) == 1
    error = capsys.readouterr().err
    assert str(path) in error and ("no such file" if content is None else "no spans") in error
