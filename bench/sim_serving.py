"""bench sim's engines in service: each one's REST API (its state, the steps it recorded), and the
simulated engines configured as the real ones are."""

from __future__ import annotations

import dataclasses
import json
import urllib.request
from pathlib import Path

from kvmesh.infra.local.state import read_state
from kvmesh.sim.engine import EngineSpec
from kvmesh.sim.link import KVGeometry
from kvmesh.sim.served_steps import engine_steps
from kvmesh.sim.topology import Topology

from . import serve

Steps = dict[str, list[dict]]  # engine id -> the steps it recorded (GET /v1/steps)


@dataclasses.dataclass
class ServingEngine:
    """An engine's REST API, and the steps it recorded, taken a load at a time."""

    url: str
    token: str
    since: int = 0

    def get(self, path: str) -> dict:
        request = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def take(self) -> list[dict]:
        """The steps since the last take."""
        steps = engine_steps(self.url, self.since, self.token)
        self.since = steps[-1]["index"] if steps else self.since
        return steps


def serving_engines(run_dir: Path) -> dict[str, ServingEngine]:
    """A cluster's engines by id, with its service token."""
    cluster = read_state(run_dir)
    token = Path(cluster.token_file).read_text().strip()
    return {c.name: ServingEngine(c.url.rstrip("/"), token) for c in cluster.children if c.name.startswith("engine-")}


def sim_engines(topology: str, states: dict[str, dict],
                model: str = serve.MODEL) -> dict[str, tuple[str, EngineSpec, dict[str, str]]]:
    """The simulated engines of `topology` as the real ones, serving `model`, are (`states`: engine id
    -> its GET /v1/state): engine id -> (role, spec, policies)."""
    layers = kv_geometry(model).num_layers
    return {engine_id: (role, engine_spec(states[engine_id], layers), sim_policies(states[engine_id]))
            for engine_id, role in Topology.parse(topology).roles().items()}


def engine_spec(state: dict, num_layers: int) -> EngineSpec:
    """The simulated engine as the real one is: its device blocks, their size, its sequence limit and
    token budget, from its GET /v1/state; the model's layers."""
    return EngineSpec(block_size=int(state["block_size"]), num_layers=num_layers,
                      device_blocks=int(state["total_blocks"]["device"]), max_num_seqs=int(state["max_num_seqs"]),
                      token_budget=int(state["token_budget"]))


def kv_geometry(model: str) -> KVGeometry:
    """The KV of the model `kvmesh up --model` names (a preset's, or its checkpoint's config.json), in
    bfloat16 (the engine's dtype `auto` on this CPU)."""
    from kvmesh.services.engine.model_source import resolve_model
    from kvmesh.services.engine.native.models.config import ModelConfig

    source = resolve_model(model)
    if source.preset is not None:
        from kvmesh.services.engine.native.models.presets import PRESETS

        config = PRESETS[source.preset]
    else:
        config = ModelConfig.from_hf(json.loads((source.checkpoint / "config.json").read_text()))
    return KVGeometry(config.num_layers, config.num_kv_heads, config.head_dim)


def sim_policies(state: dict) -> dict[str, str]:
    """The engine's policies for the hooks the simulator runs."""
    from kvmesh.sim.engine import HOOKS

    return {hook: name for hook, name in state.get("policies", {}).items() if hook in HOOKS}
