"""`kvmesh report TRACEFILE`: where each request's time went, read from the span file.

The span file is the contract of docs/observability.md: one JSON span per line, appended by every
service. The pure steps (parse -> traces -> breakdown rows -> aggregates) come first; printing and
plotting read their results. A request's breakdown is KVDirect Fig. 14's, with the meaning
`services/admission/lifecycle.py::breakdown()` gives it, taken from the engines' phase spans:

    prefill_queue  prefill.queue            (push: + the decode engine's POST /v1/kv/reserve)
    prefill        prefill.compute
    decode_queue   end of prefill.compute -> start of kv.transfer (push: of decode.compute); 0 colocated
    transfer       kv.transfer              (0 colocated and push: push writes overlap prefill)
    decode         decode.compute
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
import msgspec
import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COMPONENTS = ("prefill_queue", "prefill", "transfer", "decode_queue", "decode")  # KVDirect Fig. 14
METRICS = ("e2e_ms", "ttft_ms", "tbt_ms", *COMPONENTS)
STATS = ("p50", "p90", "p99", "mean")
RESERVE_SPAN = "POST /v1/kv/reserve"      # push mode: admission waits for the decode engine's blocks
SHOWN_INCOMPLETE = 10                     # incomplete traces named in the summary line


class ReportError(Exception):
    """The span file cannot be reported on: missing, or without a single readable span."""


class Span(msgspec.Struct, kw_only=True):
    """One line of the span file."""

    trace_id: str
    span_id: str
    name: str
    service: str
    start_ns: int
    end_ns: int
    parent_id: str | None = None
    kind: str = "INTERNAL"
    status: str = "UNSET"
    status_message: str | None = None
    attributes: dict[str, Any] = {}
    events: list[dict[str, Any]] = []

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


class RequestRow(msgspec.Struct, kw_only=True):
    """One request's latencies (ms): what the client saw, and the breakdown by component."""

    trace_id: str
    request_id: str
    mode: str                        # pull, push or colocated
    e2e_ms: float
    ttft_ms: float | None
    tbt_ms: list[float]
    components: dict[str, float]     # COMPONENTS


class Incomplete(msgspec.Struct, kw_only=True):
    """A trace that gives no breakdown, and why."""

    trace_id: str
    request_id: str | None
    reason: str


@dataclass
class Report:
    trace_file: Path
    spans: int
    skipped_lines: list[int]         # line numbers that were not a span (a truncated last line, ...)
    traces: dict[str, list[Span]]
    rows: list[RequestRow]
    incomplete: list[Incomplete]
    aggregates: dict[str, dict[str, dict[str, float]]]   # mode -> metric -> stat -> ms


# -- parse -> traces -> rows -> aggregates -------------------------------------------------------


def read_spans(path: Path) -> tuple[list[Span], list[int]]:
    """The file's spans, and the numbers of the lines that could not be read as one."""
    if not path.is_file():
        raise ReportError(f"{path}: no such file")
    decoder = msgspec.json.Decoder(Span)
    spans, skipped = [], []
    with path.open("rb") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                spans.append(decoder.decode(line))
            except msgspec.DecodeError:  # also a line that is JSON but not a span
                skipped.append(number)
    if not spans:
        raise ReportError(f"{path}: no spans in it" + (f" ({len(skipped)} unreadable lines)" if skipped else ""))
    return spans, skipped


def group_traces(spans: list[Span]) -> dict[str, list[Span]]:
    """Spans by trace id, each trace's spans in start order, traces in the order they began."""
    traces: dict[str, list[Span]] = defaultdict(list)
    for span in sorted(spans, key=lambda s: s.start_ns):
        traces[span.trace_id].append(span)
    return dict(traces)


def breakdown_row(trace_id: str, spans: list[Span]) -> RequestRow | Incomplete:
    """One trace's request and its breakdown; Incomplete when there is no admission span, the request
    did not finish, or a phase the mode needs is missing."""
    admission = _last("admission", spans)
    if admission is None:
        return Incomplete(trace_id=trace_id, request_id=None, reason="no admission span")
    attributes = admission.attributes
    request_id = str(attributes.get("kvmesh.request_id", trace_id))
    finish = attributes.get("kvmesh.finish_reason")
    if admission.status == "ERROR" or finish in ("abort", "error"):
        reason = ": ".join(str(part) for part in (finish or "error", admission.status_message) if part)
        return Incomplete(trace_id=trace_id, request_id=request_id, reason=reason)
    mode = attributes.get("kvmesh.transfer_mode") or ("pull" if _last("kv.transfer", spans) else "colocated")
    phases = {name: _last(name, spans) for name in _needed_phases(mode, spans)}
    missing = [name for name, span in phases.items() if span is None]
    if missing:
        return Incomplete(trace_id=trace_id, request_id=request_id, reason=f"no {', '.join(missing)} span")
    e2e = attributes.get("kvmesh.e2e_ms", admission.duration_ms)
    ttft = attributes.get("kvmesh.ttft_ms")
    return RequestRow(trace_id=trace_id, request_id=request_id, mode=mode, e2e_ms=float(e2e),
                      ttft_ms=None if ttft is None else float(ttft),
                      tbt_ms=[float(gap) for gap in attributes.get("kvmesh.tbt_ms") or ()],
                      components=_components(mode, phases, _last(RESERVE_SPAN, spans)))


def _needed_phases(mode: str, spans: list[Span]) -> tuple[str, ...]:
    if mode != "colocated" and _last("decode", spans) is None:
        return "prefill.queue", "prefill.compute"  # finished at the prefill engine: no decode hop
    if mode == "pull":
        return "prefill.queue", "prefill.compute", "kv.transfer", "decode.compute"
    return "prefill.queue", "prefill.compute", "decode.compute"


def _components(mode: str, phases: dict[str, Span], reserve: Span | None) -> dict[str, float]:
    prefill = phases["prefill.compute"]
    times = {"prefill_queue": phases["prefill.queue"].duration_ms, "prefill": prefill.duration_ms,
             "transfer": 0.0, "decode_queue": 0.0, "decode": 0.0}
    decode = phases.get("decode.compute")
    if decode is not None:
        times["decode"] = decode.duration_ms
    if mode == "pull" and "kv.transfer" in phases:
        transfer = phases["kv.transfer"]
        times["transfer"] = transfer.duration_ms
        times["decode_queue"] = _gap_ms(prefill.end_ns, transfer.start_ns)
    elif mode == "push":
        times["prefill_queue"] += reserve.duration_ms if reserve is not None else 0.0
        times["decode_queue"] = _gap_ms(prefill.end_ns, decode.start_ns) if decode is not None else 0.0
    return times


def _gap_ms(start_ns: int, end_ns: int) -> float:
    return max(0.0, (end_ns - start_ns) / 1e6)


def _last(name: str, spans: list[Span]) -> Span | None:
    """The span of that name that ended last, preferring ones without an error: after a retry, the
    attempt that served the request."""
    named = [s for s in spans if s.name == name]
    ok = [s for s in named if s.status != "ERROR"] or named
    return max(ok, key=lambda s: s.end_ns, default=None)


def aggregates(rows: list[RequestRow]) -> dict[str, dict[str, dict[str, float]]]:
    """Per transfer mode, p50/p90/p99/mean of every metric; TBT over every gap of every request."""
    by_mode: dict[str, list[RequestRow]] = defaultdict(list)
    for row in rows:
        by_mode[row.mode].append(row)
    return {mode: {metric: _stats(_values(metric, mode_rows)) for metric in METRICS}
            for mode, mode_rows in sorted(by_mode.items())}


def _values(metric: str, rows: list[RequestRow]) -> list[float]:
    if metric == "tbt_ms":
        return [gap for row in rows for gap in row.tbt_ms]
    if metric in COMPONENTS:
        return [row.components[metric] for row in rows]
    return [value for row in rows if (value := getattr(row, metric)) is not None]


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {stat: float("nan") for stat in STATS}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(np.mean(values))}


def percentile_request(rows: list[RequestRow], q: float) -> RequestRow:
    """The request at the q-th percentile of end-to-end latency (nearest rank)."""
    ordered = sorted(rows, key=lambda row: row.e2e_ms)
    return ordered[max(0, int(np.ceil(q / 100 * len(ordered))) - 1)]


def build_report(path: Path) -> Report:
    spans, skipped = read_spans(path)
    traces = group_traces(spans)
    results = [breakdown_row(trace_id, trace) for trace_id, trace in traces.items()]
    rows = [r for r in results if isinstance(r, RequestRow)]
    return Report(trace_file=path, spans=len(spans), skipped_lines=skipped, traces=traces, rows=rows,
                  incomplete=[r for r in results if isinstance(r, Incomplete)], aggregates=aggregates(rows))


def span_tree(spans: list[Span]) -> list[tuple[str, Span]]:
    """Depth-first, children in start order: each span with the tree drawing that leads its name.
    A span whose parent is not in the file (not exported, or another trace's) starts a tree of its own."""
    ids = {s.span_id for s in spans}
    children: dict[str | None, list[Span]] = defaultdict(list)
    roots = []
    for span in sorted(spans, key=lambda s: s.start_ns):
        (children[span.parent_id] if span.parent_id in ids else roots).append(span)
    lines: list[tuple[str, Span]] = []

    def walk(span: Span, branch: str, lead: str) -> None:
        lines.append((branch, span))
        kids = children[span.span_id]
        for i, kid in enumerate(kids):
            last = i == len(kids) - 1
            walk(kid, lead + ("└── " if last else "├── "), lead + ("    " if last else "│   "))

    for root in roots:
        walk(root, "", "")
    return lines


def key_attributes(span: Span) -> str:
    """The span's own `kvmesh.` attributes worth a glance (lists and the request id left out)."""
    shown = [f"{key.removeprefix('kvmesh.')}={_short(value)}" for key, value in span.attributes.items()
             if key.startswith("kvmesh.") and key != "kvmesh.request_id" and not isinstance(value, (list, dict))]
    return " ".join(shown)


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def report_json(report: Report) -> dict[str, Any]:
    return {"trace_file": str(report.trace_file), "spans": report.spans, "skipped_lines": report.skipped_lines,
            "traces": len(report.traces), "requests": report.rows, "incomplete": report.incomplete,
            "aggregates": report.aggregates}


# -- printing -------------------------------------------------------------------------------------


def print_report(report: Report, console: Console, slowest: int) -> None:
    console.print(_requests_table(report.rows))
    for mode, metrics in report.aggregates.items():
        console.print(_aggregate_table(mode, metrics, sum(row.mode == mode for row in report.rows)))
    for row in sorted(report.rows, key=lambda r: r.e2e_ms, reverse=True)[:slowest]:
        console.print(_tree_table(row, report.traces[row.trace_id]))
    console.print(summary_line(report), markup=False)


def summary_line(report: Report) -> str:
    parts = [f"{report.spans} spans in {len(report.traces)} traces; {len(report.rows)} requests broken down"]
    if report.incomplete:
        named = ", ".join(f"{i.request_id or i.trace_id} ({i.reason})" for i in report.incomplete[:SHOWN_INCOMPLETE])
        more = len(report.incomplete) - SHOWN_INCOMPLETE
        parts.append(f"{len(report.incomplete)} incomplete: {named}" + (f", and {more} more" if more > 0 else ""))
    if report.skipped_lines:
        parts.append(f"{len(report.skipped_lines)} unreadable lines skipped "
                     f"(line {', '.join(map(str, report.skipped_lines[:SHOWN_INCOMPLETE]))})")
    return "; ".join(parts)


def _requests_table(rows: list[RequestRow]) -> Table:
    table = Table(title="requests (ms)")
    for column in ("request", "mode", "e2e", "ttft", *(c.replace("_", " ") for c in COMPONENTS)):
        table.add_column(column, justify="left" if column in ("request", "mode") else "right")
    for row in rows:
        table.add_row(Text(row.request_id), row.mode, _ms(row.e2e_ms), _ms(row.ttft_ms),
                      *(_ms(row.components[c]) for c in COMPONENTS))
    return table


def _aggregate_table(mode: str, metrics: dict[str, dict[str, float]], count: int) -> Table:
    table = Table(title=f"{mode}: {count} requests (ms)")
    table.add_column("metric")
    for stat in STATS:
        table.add_column(stat, justify="right")
    for metric, stats in metrics.items():
        table.add_row(metric.removesuffix("_ms").replace("_", " "), *(_ms(stats[s]) for s in STATS))
    return table


def _tree_table(row: RequestRow, spans: list[Span]) -> Table:
    began = min(s.start_ns for s in spans)
    table = Table(title=Text(f"{row.request_id}: {row.mode}, {row.e2e_ms:.1f} ms end to end"), title_justify="left")
    for column, justify in (("span", "left"), ("service", "left"), ("ms", "right"), ("at ms", "right"),
                            ("status", "left"), ("attributes", "left")):
        table.add_column(column, justify=justify, no_wrap=column == "span")
    for branch, span in span_tree(spans):
        status = span.status if span.status_message is None else f"{span.status}: {span.status_message}"
        table.add_row(Text(branch + span.name), Text(span.service), _ms(span.duration_ms),
                      _ms((span.start_ns - began) / 1e6), Text(status), Text(key_attributes(span)))
    return table


def _ms(value: float | None) -> str:
    return "-" if value is None or np.isnan(value) else f"{value:.1f}"


# -- plots ----------------------------------------------------------------------------------------


def plot_breakdown(rows: list[RequestRow], path: Path) -> Path:
    """Stacked components per transfer mode (KVDirect Fig. 14): the mean, and the P90 request's."""
    modes = sorted({row.mode for row in rows})
    mean = [{c: float(np.mean([r.components[c] for r in rows if r.mode == m])) for c in COMPONENTS} for m in modes]
    p90 = [percentile_request([r for r in rows if r.mode == m], 90).components for m in modes]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5), sharey=False)
    for ax, bars, title in ((axes[0], mean, "mean request"), (axes[1], p90, "P90 request (end to end)")):
        bottom = np.zeros(len(modes))
        for component in COMPONENTS:
            heights = np.array([bar[component] for bar in bars])
            ax.bar(modes, heights, bottom=bottom, label=component.replace("_", " "))
            bottom += heights
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("latency breakdown by transfer mode (KVDirect Fig. 14)")
    return _save(fig, path)


def plot_latency_cdf(rows: list[RequestRow], path: Path) -> Path:
    """CDFs of TTFT (one per request) and TBT (every gap between tokens), per transfer mode."""
    fig, (ttft_ax, tbt_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in sorted({row.mode for row in rows}):
        mode_rows = [row for row in rows if row.mode == mode]
        for ax, metric in ((ttft_ax, "ttft_ms"), (tbt_ax, "tbt_ms")):
            values = _values(metric, mode_rows)
            if values:
                ax.ecdf(values, label=mode)
    for ax, title in ((ttft_ax, "TTFT"), (tbt_ax, "TBT, every gap between tokens")):
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_outputs(report: Report, out_dir: Path, json_path: Path | None) -> list[Path]:
    """The PNGs (when a request was broken down) and the JSON; the paths written."""
    written = []
    if report.rows:
        written += [plot_breakdown(report.rows, out_dir / "breakdown.png"),
                    plot_latency_cdf(report.rows, out_dir / "latency_cdf.png")]
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_bytes(msgspec.json.format(msgspec.json.encode(report_json(report))))
        written.append(json_path)
    return written


def run(trace_file: Path, out_dir: Path | None = None, json_path: Path | None = None, slowest: int = 5,
        console: Console | None = None) -> int:
    """`kvmesh report`: print the tables and trees, write the PNGs and the JSON; 1 on an unusable file."""
    console = console or Console(highlight=False)
    try:
        report = build_report(trace_file)
    except ReportError as exc:
        print(f"kvmesh report: {exc}", file=sys.stderr)
        return 1
    print_report(report, console, slowest)
    for path in write_outputs(report, out_dir or trace_file.parent, json_path):
        console.print(f"wrote {path}", markup=False)
    if not report.rows:
        console.print("no request was broken down: no plots")
    return 0
