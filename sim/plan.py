"""`kvmesh plan`: for a workload and its SLOs, the configuration with the highest SLO goodput per
engine, searched in the simulator over topologies (colocated:N, pd:P:D), engine counts and policies
(routing, pull or push, admission's front door, LayerKV's layer offload, KV allocation, preemption
order and strategy, and on conversations the prefix cache); the runner-up, which SLO binds it and at
what rate; and how many replicas of the pick serve the rate asked.

Goodput is DistServe's (OSDI'24): the highest arrival rate at which at least X% of requests meet every
SLO, found for each configuration by bisection on one workload (sim/plan_search.py); per engine, it is
divided by the configuration's engine count. Every request counts: one the front door refused is a
failure."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from .conversations import Conversations
from .engine import EngineSpec
from .link import KVGeometry
from .plan_search import (SEARCHED, Candidate, Goodput, Run, Simulator, bisect_goodput, cache_choices, engine_choices,
                          front_door_choices, layer_offload_choices, parse_counts, parse_slos, routing_choices,
                          search_space)
from .plan_workload import PREDICTOR, estimate_rule
from .step_cost import load_profile
from .workload import Lengths

HORIZON = 10  # a run's arrivals last at least this many times the loosest TTFT or end-to-end SLO
LIVES = 3     # and conversations' starts this many times a conversation's think times


@dataclass(frozen=True, slots=True)
class Result:
    candidate: Candidate
    goodput: Goodput

    @property
    def per_engine(self) -> float:
        return self.goodput.rate / self.candidate.engines


def run(profile: str, rate: float, prompt: str, output: str, slos: list[str], attainment: float, spec: EngineSpec,
        engines: str, kinds: list[str], routings: list[str] | None, transfer_modes: list[str],
        searched: dict[str, list[str]], requests: int, seed: int, tolerance: float, json_path: Path | None,
        plot_path: Path | None, geometry: KVGeometry = KVGeometry(), policies: dict[str, str] | None = None,
        conversation: Conversations | None = None, caches: tuple[str, ...] = ("none", "lru", "car"),
        front_doors: tuple[str, ...] = ("off", "on"), layer_offloads: tuple[str, ...] = ("none", "layerkv")) -> int:
    """`attainment`: the percentage of requests that must meet every SLO; `routings`: None for
    routing_choices' default; `searched`: the names searched for each engine hook of SEARCHED;
    `policies`: engine policies every configuration runs (one of a searched hook fixes it);
    `conversation`: conversations instead of lone requests (its rate unused: `rate` is conversations
    started per second), and `caches` the prefix caches searched on them; `front_doors`: off, on or
    both (on only with a TTFT or end-to-end SLO: front_door_choices); `layer_offloads`: none, layerkv or
    both (layerkv only where the engines can: layer_offload_choices). Bad input: a message on
    stderr, exit status 2, nothing run or written."""
    try:
        if rate <= 0 or not 0 < attainment <= 100 or not 0 < tolerance < 1 or requests < 1:
            raise ValueError(f"rate must be above 0 (got {rate}), attainment in (0, 100] (got {attainment}), "
                             f"tolerance in (0, 1) (got {tolerance}), requests at least 1 (got {requests})")
        fixed, choices = engine_choices(policies or {}, searched, spec.cxl_blocks > 0)
        simulator = Simulator(Lengths.parse(prompt), Lengths.parse(output), requests, seed, parse_slos(slos), spec,
                              load_profile(profile), geometry=geometry, policies=fixed, conversation=conversation)
        counts = parse_counts(engines)
        routings = routing_choices(routings, conversation is not None)
        cached = cache_choices(caches, conversation is not None, spec.cxl_blocks > 0)
        doors = front_door_choices(front_doors, simulator.slos)
        layers = layer_offload_choices(layer_offloads, spec, simulator.geometry)
        space = search_space(counts, kinds, routings, transfer_modes, choices, cached, doors, layers)
    except (KeyError, ValueError, FileNotFoundError) as exc:
        print(f"kvmesh plan: {exc.args[0] if exc.args else exc}", file=sys.stderr)  # a KeyError's str quotes it
        return 2
    target = attainment / 100
    results = _search(space, simulator, rate, target, tolerance)
    ranked = sorted(results, key=lambda r: -r.per_engine)  # stable: a tie goes to the one listed first
    pick = _pick(ranked, simulator, rate, target)
    print(_table(ranked, simulator))
    print("\n".join(pick["lines"]))
    predictions = _predictions(choices["kv_allocation"])
    if predictions:
        print(f"predicted output lengths ({', '.join(predictions['rules'])}): {predictions['model']}")
    config = {"profile": profile, "rate_rps": rate, "prompt": prompt, "output": output,
              "workload": _workload(conversation),
              "slos_ms": {name: limit * 1e3 for name, limit in simulator.slos.items()}, "attainment": target,
              "engine": asdict(spec),
              "search": {"engines": counts, "topologies": kinds, "routing": routings, "caches": cached,
                         "front_door": doors, "layerkv": layers,
                         "transfer_modes": transfer_modes, **{hook: names for hook, names in choices.items()}},
              "engine_policies": simulator.policies, "predictions": predictions,
              "requests": requests, "seed": seed, "tolerance": tolerance, "link": asdict(simulator.link),
              "kv_geometry": asdict(simulator.geometry), "simulations": simulator.simulated, "shared": simulator.shared}
    if json_path is not None:
        body = {"plan": "goodput", "config": config, "results": [_result(r, simulator) for r in ranked],
                "pick": {key: value for key, value in pick.items() if key != "lines"}}
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(body, indent=2) + "\n")
    if plot_path is not None:
        from .plan_plot import plot  # matplotlib only when a plot is asked for
        plot([(_label(group), group[0]) for group in _same_runs(ranked, simulator)], target, plot_path, simulator.unit)
    return 0


def _workload(conversation: Conversations | None) -> dict:
    """What a request is, and what the rates count."""
    if conversation is None:
        return {"kind": "requests", "rate_counts": "requests arriving per second (Poisson)"}
    return {"kind": "conversations", "rate_counts": "conversations started per second (Poisson); attainment "
                                                    "counts their turns", "turns": conversation.turns,
            "think_s": conversation.think_s, "system_prompt": conversation.system,
            "max_context": conversation.max_context, "sent": "closed loop: a turn a think time after the "
                                                             "answer before it ended"}


def _predictions(allocations: list[str]) -> dict | None:
    """What the allocations that read a predicted output length are given (plan_workload.py)."""
    rules = {name: estimate_rule(name) for name in allocations if estimate_rule(name) != "none"}
    if not rules:
        return None
    return {"rules": rules, "log_sigma": PREDICTOR.log_sigma, "direction_accuracy": PREDICTOR.direction_accuracy,
            "model": f"each request's real output length times exp(N(0, {PREDICTOR.log_sigma:g})), its direction "
                     f"right {PREDICTOR.direction_accuracy:.0%} of the time, padded by the policy's rule "
                     f"and capped at the workload's longest output"}


def _search(space: list[Candidate], simulator: Simulator, rate: float, target: float,
            tolerance: float) -> list[Result]:
    results = []
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("configurations", total=len(space))
        for candidate in space:
            def attained(at: float, candidate: Candidate = candidate) -> float:
                progress.update(task, description=f"{candidate} @ {at:.3g} {simulator.unit}")
                return simulator.run(candidate, at).attainment["all"]

            results.append(Result(candidate, bisect_goodput(attained, target, rate, tolerance)))
            progress.advance(task)
    return results


def _same_runs(ranked: list[Result], simulator: Simulator) -> list[list[Result]]:
    """Neighbours in the ranking that differ only in engine hooks of SEARCHED and ran the same runs,
    every figure equal (nobody was preempted, or no allocation fell short), as one group."""
    groups: list[list[Result]] = []
    for result in ranked:
        if groups and _ran_alike(groups[-1][0], result, simulator):
            groups[-1].append(result)
        else:
            groups.append([result])
    return groups


def _ran_alike(one: Result, other: Result, simulator: Simulator) -> bool:
    if _without_hooks(one.candidate) != _without_hooks(other.candidate) or one.goodput.probes != other.goodput.probes:
        return False
    return all(simulator.run(one.candidate, at) == simulator.run(other.candidate, at) for at, _ in one.goodput.probes)


def _without_hooks(candidate: Candidate) -> Candidate:
    return replace(candidate, **{hook: "" for hook in SEARCHED})


def _label(group: list[Result]) -> str:
    """A group's configuration, the names of each searched hook joined by `|` when the group is every
    combination of them; else each configuration, joined by `; `."""
    names = {hook: list(dict.fromkeys(getattr(r.candidate, hook) for r in group)) for hook in SEARCHED}
    if len(group) != math.prod(len(each) for each in names.values()):
        return "; ".join(str(r.candidate) for r in group)
    return str(replace(group[0].candidate, **{hook: "|".join(each) for hook, each in names.items()}))


def _pick(ranked: list[Result], simulator: Simulator, rate: float, target: float) -> dict:
    """The winner; the configurations tied with it; the runner-up (the best with a lower goodput per
    engine) and the best of each other topology, with the SLO that binds each at the first rate it
    misses and how the winner does there; and the replicas of the winner the rate asked needs."""
    groups = _same_runs(ranked, simulator)
    winner = groups[0][0]
    ties = [_label(g) for g in groups[1:] if g[0].per_engine == winner.per_engine]
    runner = next((g for g in groups if g[0].per_engine < winner.per_engine), None)
    best: dict[str, list[Result]] = {}  # each topology's best, best first
    for group in groups:
        best.setdefault(str(group[0].candidate.topology), group)
    others = [g for name, g in best.items() if name != str(winner.candidate.topology) and g is not runner]
    unit = simulator.unit
    lines = [f"pick: {_label(groups[0])}: goodput {_rate(winner.goodput, unit)}, {winner.per_engine:.2f} {unit} per "
             f"engine"
             f"{_limit(winner, simulator)}"]
    if ties:
        lines.append(f"tied with it: {'; '.join(ties)}")
    short = _short_horizon(winner, simulator)
    lines += [short] if short else []
    if winner.goodput.failed_at is None:
        lines.append("note: no rate up to the search's ceiling missed: the SLOs do not bound the pick's queue "
                     "(a TPOT SLO alone holds however long requests wait); add a ttft or e2e SLO")
    if runner is None:
        lines.append("runner-up: none (every configuration reached the same goodput per engine)")
    compared = []
    for title, group in ([("runner-up", runner)] if runner else []) + [(f"best {g[0].candidate.topology}", g)
                                                                        for g in others]:
        lines.append(f"{title}: {_label(group)}: goodput {_rate(group[0].goodput, unit)}, "
                     f"{group[0].per_engine:.2f} {unit} per engine")
        why, line = _why(winner, group[0], simulator, target)
        compared.append({"role": title, "configuration": _label(group), "goodput_rps": group[0].goodput.rate,
                         "goodput_per_engine_rps": group[0].per_engine, "why": why})
        lines += [line] if line else []
    replicas = math.ceil(rate / winner.goodput.rate - 1e-9) if winner.goodput.rate > 0 else None
    lines.append(f"replicas: {replicas} of the pick ({replicas * winner.candidate.engines} engines) serve {rate:g} "
                 f"{unit}, {rate / replicas:.2f} each" if replicas else
                 f"replicas: none serve {rate:g} {unit}: the pick met the SLOs at no rate tried")
    return {"winner": {**_candidate(winner.candidate), "same_runs": _label(groups[0])},
            "goodput_rps": winner.goodput.rate, "goodput_per_engine_rps": winner.per_engine, "ties": ties,
            "runner_up": None if runner is None else compared[0], "other_topologies": compared[1 if runner else 0:],
            "replicas": replicas, "engines_total": replicas and replicas * winner.candidate.engines,
            "short_horizon": short, "lines": lines}


def _short_horizon(winner: Result, simulator: Simulator) -> str | None:
    """A run's arrivals at the winner's goodput must last well beyond the SLOs a queue adds to (TTFT,
    end to end): in a run of T seconds, a rate above capacity leaves its late requests queued for a
    share of T, so against a limit of T / HORIZON or less the overload shows, and a goodput found on a
    shorter run can be past what the configuration sustains. Conversations: their starts last the
    run's requests over its turns per conversation over the rate, and must also outlast a
    conversation's life (its turns' think times) LIVES times, or the conversations alive at once never
    reach their steady count (Little's law: the rate times a life): a closed loop's load is bounded by
    how many there are."""
    queued = {name: limit for name, limit in simulator.slos.items() if name in ("ttft", "e2e")}
    conversation = simulator.conversation
    turns = 1 if conversation is None else conversation.turns
    limits = {f"{name} SLO": HORIZON * limit for name, limit in queued.items()}
    if conversation is not None:
        limits["conversation's life"] = LIVES * turns * conversation.think_s
    if not limits or winner.goodput.rate <= 0:
        return None
    horizon, (name, needed) = simulator.requests / turns / winner.goodput.rate, max(limits.items(),
                                                                                      key=lambda kv: kv[1])
    if horizon >= needed:
        return None
    enough = math.ceil(needed * winner.goodput.rate) * turns
    times = f"{HORIZON}x the {name}" if name.endswith("SLO") else f"{LIVES}x a {name} ({turns} think times)"
    return (f"note: at the pick's goodput a run's arrivals last {horizon:.1f} s, under {times} ({needed:g} s): "
            f"an overload that short can pass; give --requests {enough} or more to be sure")


def _why(winner: Result, other: Result, simulator: Simulator, target: float) -> tuple[dict | None, str]:
    """At the first rate `other` misses: the SLO that binds it, and how many meet every SLO on the winner."""
    at = other.goodput.failed_at
    if at is None:
        return None, ""
    missed, held = simulator.run(other.candidate, at), simulator.run(winner.candidate, at)
    binding = _binding(missed, simulator.slos)
    return ({"rate_rps": at, "binding_slo": binding, "it": _run(missed), "pick": _run(held)},
            f"  why: at {at:.2f} {simulator.unit} it meets every SLO for {missed.attainment['all']:.1%} of "
            f"{'requests' if simulator.conversation is None else 'turns'} "
            f"(target {target:.0%}); {binding} binds it ({_attained(missed, simulator.slos)}); the pick meets every "
            f"SLO there for {held.attainment['all']:.1%}{_refused_compared(missed, held, simulator)}"
            f"{_cache_compared(missed, held)}")


def _refused_compared(it: Run, pick: Run, simulator: Simulator) -> str:
    """How many the front door refused, of each, where either ran one (refused: failures)."""
    if it.refused is None and pick.refused is None:
        return ""
    total = simulator.requests
    return "; refused at the front door: " + ", ".join(
        f"{who} {'no door' if run.refused is None else f'{run.refused / total:.1%}'}" for who, run in
        (("it", it), ("the pick", pick)))


def _cache_compared(it: Run, pick: Run) -> str:
    """The prefix cache's share of prompt tokens and hit rates, of each, where either ran one."""
    if it.cache is None and pick.cache is None:
        return ""
    return f"; prompt tokens cached (hits on device / cxl): it {_hits(it)}, the pick {_hits(pick)}"


def _hits(run: Run) -> str:
    cache = run.cache
    if cache is None:
        return "no cache"
    return f"{cache['prompt_tokens_cached']:.1%} ({cache['hit_rate_device']:.1%} / {cache['hit_rate_cxl']:.1%})"


def _binding(run: Run, slos: dict[str, float]) -> str:
    """The SLO the fewest requests meet."""
    return min(slos, key=lambda name: run.attainment[name])


def _attained(run: Run, slos: dict[str, float]) -> str:
    return ", ".join(f"{name} <= {limit * 1e3:g} ms: {run.attainment[name]:.1%}" for name, limit in slos.items())


def _limit(result: Result, simulator: Simulator) -> str:
    """What binds a configuration at the first rate it misses."""
    at = result.goodput.failed_at
    if at is None:
        return ""
    missed = simulator.run(result.candidate, at)
    return (f" (at {at:.2f} {simulator.unit} {_binding(missed, simulator.slos)} binds: "
            f"{_attained(missed, simulator.slos)})")


def _rate(goodput: Goodput, unit: str) -> str:
    return f"{'at least ' if goodput.failed_at is None else ''}{goodput.rate:.2f} {unit}"


def _table(ranked: list[Result], simulator: Simulator) -> str:
    cached = simulator.conversation is not None  # a column of what the cache gave, at the goodput
    header = ("configuration", "engines", f"goodput {simulator.unit}", "per engine", "first rate missed",
              "binding SLO") + (("prompt cached (device / cxl hits) at goodput",) if cached else ())
    rows = [header]
    for group in _same_runs(ranked, simulator):
        r, at = group[0], group[0].goodput.failed_at
        rows.append((_label(group), str(r.candidate.engines), _rate(r.goodput, "").rstrip(),
                     f"{r.per_engine:.2f}", "-" if at is None else f"{at:.2f}",
                     "-" if at is None else _binding(simulator.run(r.candidate, at), simulator.slos))
                    + ((_hits(simulator.run(r.candidate, r.goodput.rate)) if r.goodput.rate > 0 else "-",)
                       if cached else ()))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in
                               enumerate(zip(row, widths))) for row in rows)


def _candidate(candidate: Candidate) -> dict:
    return {"configuration": str(candidate), "topology": str(candidate.topology), "engines": candidate.engines,
            "routing": candidate.routing, "transfer_mode": candidate.transfer_mode, "cache": candidate.cache,
            "front_door": candidate.front_door, "layerkv": candidate.layerkv,
            **candidate.engine_policies}


def _run(run: Run) -> dict:
    return {"attainment": run.attainment, "ttft_p90_s": run.ttft_p90_s, "tpot_mean_s": run.tpot_mean_s,
            "e2e_p90_s": run.e2e_p90_s, "preemptions": run.preemptions, "unfinished": run.unfinished,
            "cache": run.cache, "refused": run.refused}


def _result(result: Result, simulator: Simulator) -> dict:
    return {**_candidate(result.candidate), "goodput_rps": result.goodput.rate,
            "goodput_per_engine_rps": result.per_engine, "failed_at_rps": result.goodput.failed_at,
            "probes": [{"rate_rps": at, **_run(simulator.run(result.candidate, at))}
                       for at, _ in result.goodput.probes]}
