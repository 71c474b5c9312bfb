"""`kvmesh swap`: replace a policy service, or switch the engines' policies, while the local cluster serves.

- `kvmesh swap predictor|scheduler URL` points admission at another service speaking the same API
  (`PUT /v1/upstreams`: admission refuses one that is not ready or lacks an operation it calls);
  `builtin` goes back to the cluster's own service, `off` (the predictor only) stops predicting.
- `kvmesh swap engines HOOK=NAME ...` switches engine-level policies on every engine (`PUT /v1/policy`).

Each swap is recorded in the run directory, so an admission or engine the launcher restarts, and an
engine `kvmesh scale` adds, comes up with it too; a new `kvmesh up` starts from the built-in ones.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec

from kvmesh.libs.controlplane import KvmeshError, ServiceClient

from .state import ClusterState, pid_alive, read_state

UPSTREAMS = ("predictor", "scheduler")


class Swaps(msgspec.Struct, kw_only=True):
    upstreams: dict[str, str | None] = {}     # admission's settings: scheduler_url, predictor_url
    engine_policies: dict[str, str] = {}      # by hook, over the engines' configured policies


def swaps_path(run_dir: Path) -> Path:
    return run_dir / "swaps.json"


def read_swaps(run_dir: Path) -> Swaps:
    try:
        return msgspec.json.decode(swaps_path(run_dir).read_bytes(), type=Swaps)
    except (OSError, msgspec.DecodeError):
        return Swaps()


def swapped_env(run_dir: Path, child: str, engine_policies: dict[str, str]) -> dict[str, str]:
    """What a child (re)started now must be told of the swaps so far; `engine_policies`: the engines'
    configured ones, which a swap overrides hook by hook."""
    swaps = read_swaps(run_dir)
    if child == "admission":
        return {f"KVMESH_ADMISSION_{name.upper()}": json.dumps(url) if url is None else url
                for name, url in swaps.upstreams.items()}
    if child.startswith("engine-") and swaps.engine_policies:
        return {"KVMESH_ENGINE_POLICIES": json.dumps({**engine_policies, **swaps.engine_policies})}
    return {}


def swap(run_dir: Path, target: str, values: list[str]) -> int:
    """`kvmesh swap`; returns an exit code."""
    state = read_state(run_dir)
    if state is None or not pid_alive(state.launcher_pid):
        print(f"kvmesh swap: no cluster runs from {run_dir}")
        return 1
    token = Path(state.token_file).read_text().strip()
    swaps = read_swaps(run_dir)
    try:
        if target in UPSTREAMS:
            url = _upstream_url(state, target, values)
            settings = asyncio.run(_put(_url_of(state, "admission"), token, "/v1/upstreams", {f"{target}_url": url}))
            swaps.upstreams[f"{target}_url"] = url
            print(f"kvmesh swap: admission now calls {target} at {settings[f'{target}_url'] or '(none)'}")
        else:
            policies = dict(_hook_and_name(value) for value in values)
            for engine in [c for c in state.children if c.name.startswith("engine-")]:
                answer = asyncio.run(_put(engine.url, token, "/v1/policy", {"policies": policies}))
                print(f"kvmesh swap: {engine.name} policies: {answer['policies']}")
            swaps.engine_policies.update(policies)
    except (KvmeshError, ValueError) as exc:
        print(f"kvmesh swap: {exc}")
        return 2
    tmp = swaps_path(run_dir).with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.encode(swaps))
    tmp.replace(swaps_path(run_dir))
    return 0


def _upstream_url(state: ClusterState, target: str, values: list[str]) -> str | None:
    if len(values) != 1:
        raise ValueError(f"give one URL for the {target} (or `builtin`{', `off`' if target == 'predictor' else ''})")
    if values[0] == "builtin":
        return _url_of(state, target)
    if values[0] == "off" and target == "predictor":
        return None
    return values[0]


def _url_of(state: ClusterState, name: str) -> str:
    child = next((c for c in state.children if c.name == name), None)
    if child is None:
        raise ValueError(f"the cluster runs no {name} of its own")
    return child.url


def _hook_and_name(value: str) -> tuple[str, str]:
    hook, sep, name = value.partition("=")
    if not sep or not hook or not name:
        raise ValueError(f"engine policies go as HOOK=NAME (say, preemption_order=srtf), got {value!r}")
    return hook, name


async def _put(url: str, token: str, path: str, body: dict) -> dict:
    async with ServiceClient(url, token=token, timeout=30.0, retries=0) as client:
        return await client.call("PUT", path, body, into=dict)
