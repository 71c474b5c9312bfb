"""CaR III-D's start-up profile: how sparse each layer's attention is, the keep ratios that follow,
and what they cost in quality, measured once on this engine's own model before the loop starts.

- Sparsity: prompts from the shipped corpus run through the model with a dense attention that
  materialises its probabilities; per layer, the share of causal scores under 1% of their row's
  maximum (CaR Fig. 4).
- Quality: held-out prompts, each a cached prefix of whole blocks and a continuation. The prefix
  runs dense; its last query scores the prefix's tokens as the engine's probe does
  (token_scores.py); each block of each layer then keeps its best-scored tokens, as a node does
  when it moves to the cxl tier; the continuation runs once over the dense prefix and once over
  the sparse one. The cost is the mean absolute change of the log-likelihood of each continuation
  token, in nats.
- Ratios given in the configuration are refused if their cost passes the bound; profiled ones are
  relaxed until it holds, or left dense (policies.cache.sparsify.within_bound).

Nothing here touches the pools: the profile keeps its own KV per prompt.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from kvmesh.libs.controlplane import ConfigError
from ..state import SparsityProfile
from kvmesh.policies.cache.sparsify import MAX_RELAXATIONS, NEGLIGIBLE, keep_ratios, keep_tokens, kept_slots, within_bound

log = logging.getLogger(__name__)

PROMPT_TOKENS = 128     # each profiling prompt
PROMPTS = 4             # prompts whose attention sets the sparsity
HELD_OUT = 4            # prompts whose continuations measure the quality cost
CONTINUATION = 32       # tokens of each held-out prompt after its cached prefix


def profile_sparsity(model: torch.nn.Module, tokenizer, block_size: int, floor: float, bound: float,
                     configured: Sequence[float] = ()) -> SparsityProfile:
    layers = model.config.num_layers
    prompts = corpus_prompts(tokenizer, PROMPTS + HELD_OUT, PROMPT_TOKENS)
    sparsity = layer_sparsity(model, prompts[:PROMPTS])
    held_out = prompts[PROMPTS:]
    if configured:
        if len(configured) != layers:
            raise ConfigError(f"sparsify_keep_ratios has {len(configured)} ratios; the model has {layers} layers")
        ratios = list(configured)
        cost = quality_cost(model, held_out, keep_tokens(ratios, block_size), block_size)
        if cost > bound:
            raise ConfigError(f"sparsify_keep_ratios {ratios} refused: they change held-out next-token "
                              f"log-likelihoods by {cost:.4f} nats on average, over sparsify_quality_bound {bound}")
        return SparsityProfile(sparsity=sparsity, keep_ratios=ratios, keep_tokens=keep_tokens(ratios, block_size),
                               quality_cost=cost, quality_bound=bound, relaxations=0, configured=True)
    ratios, cost, relaxations = within_bound(
        keep_ratios(sparsity, floor), lambda r: quality_cost(model, held_out, keep_tokens(r, block_size), block_size),
        bound)
    if relaxations == MAX_RELAXATIONS and min(ratios) == 1.0:   # within_bound gave up
        log.warning("sparsification: no keep ratios within %.4f nats; nodes stay dense", bound)
    return SparsityProfile(sparsity=sparsity, keep_ratios=ratios, keep_tokens=keep_tokens(ratios, block_size),
                           quality_cost=cost, quality_bound=bound, relaxations=relaxations, configured=False)


def corpus_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens: consecutive windows of the shipped corpus's prose."""
    text = (Path(__file__).parent / "models" / "corpus.txt").read_text(encoding="utf-8")
    ids = list(tokenizer.encode(text))
    while len(ids) < count * length:   # a tokenizer with long tokens: reuse the text
        ids += ids
    return [ids[i * length:(i + 1) * length] for i in range(count)]


@torch.inference_mode()
def layer_sparsity(model: torch.nn.Module, prompts: Sequence[list[int]]) -> list[float]:
    attention = DenseAttention(model.config.num_layers)
    for prompt in prompts:
        attention.reset()
        _forward(model, prompt, 0, attention)
    return [negligible / total for negligible, total in attention.counts]


@torch.inference_mode()
def quality_cost(model: torch.nn.Module, prompts: Sequence[list[int]], keep: Sequence[int], block_size: int) -> float:
    changes = []
    for prompt in prompts:
        cached = (len(prompt) - CONTINUATION) // block_size * block_size
        dense, sparse = DenseAttention(len(keep)), DenseAttention(len(keep))
        _forward(model, prompt[:cached], 0, dense, observe=True)
        sparse.kv = [list(kv) for kv in dense.kv]
        sparse.valid = [_kept(scores, k, block_size) for scores, k in zip(dense.last_scores, keep)]
        rest = prompt[cached:]
        targets = torch.tensor(rest[1:])
        for attention in (dense, sparse):
            logits = model.logits(_forward(model, rest, cached, attention))[:-1]
            attention.likelihoods = logits.log_softmax(-1).gather(1, targets[:, None].to(logits.device))[:, 0]
        changes.append((dense.likelihoods - sparse.likelihoods).abs().cpu())
    return float(torch.cat(changes).mean())


def _kept(scores: torch.Tensor, keep: int, block_size: int) -> torch.Tensor:
    """Which prefix tokens a layer keeps: per block, the `keep` best scored."""
    valid = torch.zeros(len(scores), dtype=torch.bool)
    for start in range(0, len(scores), block_size):
        for slot in kept_slots(scores[start:start + block_size].tolist(), keep):
            valid[start + slot] = True
    return valid


def _forward(model: torch.nn.Module, ids: list[int], start: int, attention: DenseAttention,
             observe: bool = False) -> torch.Tensor:
    device = next(model.parameters()).device
    attention.observe = observe
    return model(torch.tensor(ids, device=device), torch.arange(start, start + len(ids), device=device), attention)


class DenseAttention:
    """One sequence's causal attention with its probabilities in hand: counts negligible scores per
    layer, records the last query's scores (mean over heads) when observing, and leaves out keys
    that `valid` (per layer, over the keys before this call) marks as dropped."""

    def __init__(self, num_layers: int):
        self.counts = [[0, 0] for _ in range(num_layers)]  # per layer: negligible scores, causal scores
        self.reset()
        self.observe = False
        self.likelihoods: torch.Tensor | None = None

    def reset(self) -> None:
        layers = len(self.counts)
        self.kv: list[list[torch.Tensor]] = [[] for _ in range(layers)]   # per layer: [k, v] chunks so far
        self.valid: list[torch.Tensor | None] = [None] * layers
        self.last_scores: list[torch.Tensor] = [torch.empty(0)] * layers

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        before = sum(len(chunk) for chunk in self.kv[layer][::2])
        self.kv[layer] += [k.clone(), v.clone()]
        keys, values = torch.cat(self.kv[layer][::2]).float(), torch.cat(self.kv[layer][1::2]).float()
        t, heads, dim = q.shape
        group = heads // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("thd,shd->hts", q.float(), keys) * dim ** -0.5
        allowed = torch.arange(len(keys), device=q.device)[None, :] <= before + torch.arange(t, device=q.device)[:, None]
        if self.valid[layer] is not None:
            allowed[:, :before] &= self.valid[layer].to(q.device)
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        row_max = probs.amax(-1, keepdim=True)
        self.counts[layer][0] += int(((probs < NEGLIGIBLE * row_max) & allowed).sum())
        self.counts[layer][1] += int(allowed.sum()) * heads
        if self.observe:
            self.last_scores[layer] = probs[:, -1].mean(0).cpu()
        return torch.einsum("hts,shd->thd", probs, values).to(q.dtype)
