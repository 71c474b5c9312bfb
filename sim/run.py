"""`kvmesh sim run`: a Poisson workload through a simulated cluster (one colocated engine unless a
topology says otherwise), with a named step-cost profile, named policies and a link model for the KV
hand-off, or conversations started at the rate, sent closed-loop (sim/conversations.py), with a
prefix cache by name (sim/cache_choice.py); prints the latency figures, the transfer's share, the
preemptions by strategy and what the swaps to a cxl tier copied, what the prefix cache gave, and how
fast the simulation ran. With `admission` (or a `predictor`), admission's front door stands in front of
the cluster (sim/admission.py) and what it refused is counted."""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

from kvmesh.policies.admission import AdmissionLimits
from kvmesh.policies.routing import registry

from .admission import AdmittedCluster
from .cache_choice import cache_figures, with_cache
from .cluster import HEARTBEAT_S, Cluster, build
from .conversations import ConversationLoop, Conversations, conversation_turns
from .engine import EngineSpec
from .front_door import RATE_WINDOW_S, FrontDoor, PredictorSettings
from .link import KVGeometry, LinkSpec
from .metrics import summarise
from .step_cost import load_profile
from .topology import Topology
from .workload import Lengths, poisson


def run(profile: str, rate: float, requests: int, prompt: str, output: str, seed: int, spec: EngineSpec,
        policies: dict[str, str], json_path: Path | None, topology: str = "colocated:1",
        routing: str = registry.DEFAULT, link: LinkSpec = LinkSpec(), geometry: KVGeometry = KVGeometry(),
        transfer_mode: str = "pull", heartbeat_s: float = HEARTBEAT_S, conversation: Conversations | None = None,
        cache: str = "none", admission: AdmissionLimits | None = None, predictor: str | None = None,
        rate_window_s: float = RATE_WINDOW_S) -> int:
    """`conversation`: conversations instead of lone requests, `rate` of them started a second and
    `requests` turns in all; `cache`: the engines' prefix cache (its policies, unless `policies` names them);
    `admission`: admission's front door with these limits (admission's defaults when only `predictor`,
    the length predictor by name, is given; its arrival rate over `rate_window_s`), in front of lone
    requests or conversations (a refused turn ends its conversation)."""
    if predictor is not None and admission is None:
        admission = AdmissionLimits()
    spec, cache_policies = with_cache(spec, cache)
    policies = cache_policies | policies
    if conversation is None:
        workload, talks = poisson(rate, requests, Lengths.parse(prompt), Lengths.parse(output), seed), None
    else:
        talks = conversation_turns(replace(conversation, rate=rate), requests, spec.block_size, seed)
        workload = [request for talk in talks for request, _ in talk]
    served = dict(routing=routing, link=link, geometry=geometry, transfer_mode=transfer_mode, heartbeat_s=heartbeat_s)
    if admission is not None:  # every client sends the workload's longest output as max_tokens
        settings = None if predictor is None else \
            PredictorSettings(predictor, max(r.max_tokens for r in workload), rate_window_s)
        cluster = AdmittedCluster.build(Topology.parse(topology), spec, load_profile(profile), policies,
                                        FrontDoor(admission, settings), talks, **served)
    elif talks is None:
        cluster = build(Topology.parse(topology), spec, load_profile(profile), policies, **served)
    else:
        cluster = ConversationLoop.build(Topology.parse(topology), spec, load_profile(profile), policies, talks,
                                         **served)
    start = time.perf_counter()
    sim_seconds = cluster.run(workload)
    summary = summarise(workload, sim_seconds, time.perf_counter() - start) | swaps(cluster, spec) | \
        {"cache": cache_figures(workload, cluster)} | \
        {"admission": cluster.figures() if isinstance(cluster, AdmittedCluster) else None}
    config = {"profile": profile, "rate": rate, "requests": requests, "prompt": prompt, "output": output,
              "seed": seed, "engine": asdict(spec),
              "policies": next(iter(cluster.members.values())).engine.names, "topology": topology,
              "routing": routing, "heartbeat_s": heartbeat_s, "transfer_mode": transfer_mode, "link": asdict(link),
              "kv_geometry": asdict(geometry), "cache": cache,
              "conversations": None if conversation is None else
              {"turns": conversation.turns, "think_s": conversation.think_s, "system_prompt": conversation.system,
               "max_context": conversation.max_context, "rate_counts": "conversations started per second"},
              "admission": None if admission is None else
              asdict(admission) | {"predictor": predictor, "rate_window_s": rate_window_s}}
    print(_table(summary, cxl=spec.cxl_blocks > 0))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"sim": "run", "config": config, "results": summary}, indent=2) + "\n")
    return 0


def swaps(cluster: Cluster, spec: EngineSpec) -> dict:
    """Every engine's preemptions by the strategy carried out (a swap without room in the cxl tier
    recomputes), and the bytes its swaps copied each way."""
    engines = [member.engine for member in cluster.members.values()]
    moved = sum((engine.blocks.moved for engine in engines), Counter())
    return {"preemptions_by_strategy": dict(Counter(how for engine in engines for _, _, how in engine.preemptions)),
            "swap_out_bytes": moved["cxl"] * spec.block_bytes, "swap_in_bytes": moved["device"] * spec.block_bytes}


def _table(summary: dict, cxl: bool) -> str:
    def ms_of(seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"

    def ms(key: str) -> str:
        return ms_of(summary[key])

    def rate(key: str, unit: str) -> str:
        return "-" if summary[key] is None else f"{summary[key]:.1f} {unit}"

    by_strategy = ", ".join(f"{how} {n}" for how, n in sorted(summary["preemptions_by_strategy"].items()))
    rows = [("requests (unfinished)", f"{summary['requests']} ({summary['unfinished']})"),
            ("TTFT P50 / P90", f"{ms('ttft_p50_s')} / {ms('ttft_p90_s')}"), ("TPOT mean", ms("tpot_mean_s")),
            ("end-to-end P90", ms("e2e_p90_s")),
            ("KV transfer mean (share)", "-" if summary["transfer_mean_s"] is None else
             f"{ms('transfer_mean_s')} ({summary['transfer_share']:.1%} of end-to-end)"),
            ("throughput", rate("throughput_tok_s", "tokens/s")),
            ("requests/s", rate("throughput_req_s", "req/s")),
            ("preemptions", f"{summary['preemptions']} ({by_strategy})" if by_strategy else "0")]
    if summary["cache"] is not None:
        hits = summary["cache"]
        rows.append(("prompt tokens cached (hits)", f"{hits['prompt_tokens_cached']:.1%} ({hits['hit_rate_device']:.1%}"
                                                    f" device, {hits['hit_rate_cxl']:.1%} cxl)"))
    if summary["admission"] is not None:
        door = summary["admission"]
        refused = ", ".join(f"{why} {n}" for why, n in sorted(door["refused_by"].items()))
        rows += [("admission: refused", f"{door['refused']} ({refused})" if refused else "0"),
                 ("admission: queued (wait P90)", f"{door['queued']} ({ms_of(door['queue_wait_p90_s'])})")]
    if cxl:
        rows.append(("swap copies out / in", f"{summary['swap_out_bytes'] / 1e6:.1f} / "
                                             f"{summary['swap_in_bytes'] / 1e6:.1f} MB"))
    rows.append(("simulated / wall", f"{summary['sim_seconds']:.1f} s in {summary['wall_seconds']:.2f} s "
                                     f"({rate('sim_per_wall', 'sim s per wall s')})"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
