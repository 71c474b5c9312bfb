"""The car benchmark's sparsification part (CaR III-D): its model, and its figure.

A randomly initialised model attends almost uniformly (the `small` preset profiles as 0-5% sparse
in every layer), so sparsifying it keeps every token: nothing to measure. Trained models attend
sharply, and more so deeper (CaR Fig. 4: ~60% of scores negligible in the first layer, ~95% in
the last). `sharp_checkpoint` stands in for one: the `small` preset with its q and k projections
scaled so that q.k grows by SHARPNESS x (1 + layer / 4)^2, which profiles as ~0.3 sparse in the
first layer rising to ~0.96. The engine then profiles, picks its ratios within the quality bound,
and drops tokens as it would for a trained model.

What such a random model lacks is a trained one's stable heavy hitters (tokens most queries attend
to, which H2O and SnapKV rely on): each of its queries attends sharply to its own few keys, so the
tokens one query scores low matter to the next, and dropping costs more quality than it would in a
trained model. At the engine's default bound (0.05 nats) its profile stays dense; the benchmark
runs sparsification at BOUND instead, and `quality_curve` reports the cost of uniform keep ratios.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
from safetensors.torch import load_file, save_file

from kvmesh.policies.cache.sparsify import keep_tokens
from kvmesh.services.engine.native.models import PRESETS, load_checkpoint, save_preset_checkpoint
from kvmesh.services.engine.native.sparsity_profile import (HELD_OUT, PROMPT_TOKENS, PROMPTS, corpus_prompts,
                                                            quality_cost)

from .report import save_figure

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SHARPNESS = 8.0
BOUND = 0.5           # nats: the quality bound the benchmark's sparsifying engine runs at
CURVE = (0.25, 0.5, 0.75, 0.875, 1.0)   # uniform keep ratios whose quality cost is reported
PLOT = Path("bench-results/car_sparsify.png")


def sharp_checkpoint(preset: str, path: Path) -> Path:
    """The preset saved as a checkpoint at `path`, its attention sharpened (see the module's docstring)."""
    save_preset_checkpoint(preset, path, seed=0)
    file = path / "model.safetensors"
    weights = load_file(file)
    for layer in range(PRESETS[preset].num_layers):
        for projection in ("q_proj", "k_proj"):
            name = f"model.layers.{layer}.self_attn.{projection}.weight"
            weights[name] = weights[name] * (SHARPNESS ** 0.5 * (1 + layer / 4))
    save_file(weights, file, metadata={"format": "pt"})
    return path


def quality_curve(checkpoint: Path, block_size: int) -> dict[float, float]:
    """The quality cost (nats, as the engine's profile measures it) of each uniform keep ratio of CURVE."""
    model, tokenizer = load_checkpoint(checkpoint)
    held_out = corpus_prompts(tokenizer, PROMPTS + HELD_OUT, PROMPT_TOKENS)[PROMPTS:]
    layers = model.config.num_layers
    return {r: quality_cost(model, held_out, keep_tokens([r] * layers, block_size), block_size) for r in CURVE}


def plot(sparsity: list[float], keep_ratios: list[float], curve: dict[float, float], profiled: tuple[float, float],
         ttft_ms: dict[str, float], mb_per_reload: dict[str, float]) -> str:
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    layers = range(len(sparsity))
    axes[0].bar([x - 0.2 for x in layers], sparsity, 0.4, label="sparsity (scores < 1% of row max)")
    axes[0].bar([x + 0.2 for x in layers], keep_ratios, 0.4, label="keep ratio chosen")
    axes[0].set_xlabel("layer")
    axes[0].set_title("CaR Fig. 4: per-layer sparsity, profiled", fontsize=9)
    axes[0].legend(fontsize=7)
    axes[1].plot(list(curve), list(curve.values()), marker="o", label="uniform keep ratio")
    axes[1].plot(*profiled, marker="*", markersize=12, linestyle="", label="profiled ratios (mean)")
    axes[1].set_xlabel("share of tokens kept")
    axes[1].set_title("quality cost: mean |change| of log-likelihood (nats)", fontsize=9)
    axes[1].legend(fontsize=7)
    for ax, (title, values) in zip(axes[2:], (("mean TTFT (ms)", ttft_ms), ("MB copied per reloaded node", mb_per_reload))):
        ax.bar(list(values), list(values.values()))
        ax.set_title(f"multi-turn: {title}", fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    return save_figure(fig, PLOT)
