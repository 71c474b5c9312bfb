"""What a simulated run measured: the latency figures the benchmarks report, and the speed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .request import SimRequest


def summarise(requests: Sequence[SimRequest], sim_seconds: float, wall_seconds: float) -> dict:
    """TTFT P50/P90, mean TPOT, P90 end-to-end latency (seconds), output tokens and requests per
    simulated second from the first arrival to the last finish, and simulated seconds per wall second.
    Unfinished requests are counted, and left out of the latencies. Of the requests split across a
    prefill and a decode engine: the mean KV transfer, and its share of their mean end-to-end latency
    (as bench serve's transfer_share)."""
    done = [r for r in requests if r.finished_at is not None]
    ttft = [r.token_times[0] - r.arrival for r in done]
    tpot = [(r.finished_at - r.token_times[0]) / (r.num_generated - 1) for r in done if r.num_generated > 1]
    e2e = [r.finished_at - r.arrival for r in done]
    handed = [r for r in done if r.transfer_s is not None]
    transfer = float(np.mean([r.transfer_s for r in handed])) if handed else None
    share = transfer / float(np.mean([r.finished_at - r.arrival for r in handed])) if handed else None
    span = max((r.finished_at for r in done), default=0.0) - min((r.arrival for r in requests), default=0.0)
    return {"requests": len(requests), "unfinished": len(requests) - len(done),
            "ttft_p50_s": _percentile(ttft, 50), "ttft_p90_s": _percentile(ttft, 90),
            "tpot_mean_s": float(np.mean(tpot)) if tpot else None, "e2e_p90_s": _percentile(e2e, 90),
            "throughput_tok_s": sum(r.num_generated for r in done) / span if span > 0 else None,
            "throughput_req_s": len(done) / span if span > 0 else None,
            "transfer_mean_s": transfer, "transfer_share": share,
            "preemptions": sum(r.preemptions for r in requests), "sim_seconds": sim_seconds,
            "wall_seconds": wall_seconds, "sim_per_wall": sim_seconds / wall_seconds if wall_seconds > 0 else None}


def slo_attainment(requests: Sequence[SimRequest], slos: Mapping[str, float]) -> dict[str, float]:
    """DistServe's attainment: the fraction of requests meeting each SLO of `slos` (seconds; `ttft`,
    `tpot`: the request's own mean time per output token after the first, `e2e`), and every one of them
    (`all`). An unfinished request meets none; a request of one token meets any TPOT."""
    met = dict.fromkeys((*slos, "all"), 0)
    for r in requests:
        if r.finished_at is None:
            continue
        figures = {"ttft": r.token_times[0] - r.arrival, "e2e": r.finished_at - r.arrival,
                   "tpot": (r.finished_at - r.token_times[0]) / max(1, r.num_generated - 1)}
        ok = {name: figures[name] <= limit for name, limit in slos.items()}
        for name, good in ok.items():
            met[name] += good
        met["all"] += all(ok.values())
    return {name: count / len(requests) for name, count in met.items()}


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None
