"""A GPU engine step's cost from published hardware numbers: a roofline with efficiency factors.

For a step of P prefill tokens, D decode tokens, C_d decode context (KV tokens the decodes read) and
C_p prefill context ((query, key) pairs the prompt chunks compute), as policies/step_shape.py counts
them, on TP GPUs:

    seconds   = overhead + max(compute, memory) + allreduce
    compute   = (2 N (P + D) + 4 L A (C_p + C_d)) / TP / (peak_flops x mfu)
    memory    = (W + k (C_d x s + P + D)) / (hbm_bandwidth x hbm_efficiency)
    allreduce = 2 L x (latency + (P + D) h b x 2 (TP - 1) / TP / busbw)       (0 when TP = 1)

- N: the blocks' matrix parameters (model_shapes.linear_params), 2 FLOPs each per token; the LM head's
  FLOPs (once per sampled sequence, not per token) are left out;
- L layers, A = heads x head_dim: QK^T and AV are 2 A FLOPs each per (query, key) pair and layer;
- W: the bytes of weights one GPU reads once a step (blocks and LM head, split TP ways);
- k: one token's KV bytes on one GPU (L x 2 x its KV heads x head_dim x b): the decodes' KV read, and
  the step's new KV written;
- s = hbm_efficiency / decode_attention_efficiency: the decode attention kernel reads the KV at its own
  share of the bandwidth, not the GEMV's (1 when a profile gives none);
- h hidden size, b the dtype's bytes: two all-reduces a layer (after attention and after the MLP) of
  the step's activations, each a ring: NCCL's bus bandwidth (busbw = algbw x 2 (n - 1) / n) and a
  fixed latency.

Every constant comes from a profile in sim/profiles with its source (sim/hardware.py loads the rest
of the deployment)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .model_shapes import MODELS, ModelShape


@dataclass(frozen=True, slots=True)
class GPU:
    """One GPU's published numbers and the efficiencies software reaches on it."""

    peak_flops: float           # dense, in the model's dtype, FLOP/s
    hbm_bytes_s: float          # memory bandwidth, bytes/s
    mfu: float                  # share of peak_flops a compute-bound step reaches
    hbm_efficiency: float       # share of hbm_bytes_s a memory-bound step reaches
    allreduce_busbw: float      # NCCL bus bandwidth of an all-reduce over the TP group, bytes/s
    allreduce_latency_s: float  # each all-reduce's fixed cost
    overhead_s: float           # each step's launch and scheduling cost
    decode_attention_efficiency: float | None = None  # share a decode's KV read reaches; None: hbm_efficiency's


@dataclass(frozen=True, slots=True)
class Roofline:
    model: ModelShape
    gpu: GPU
    tp: int = 1
    dtype_bytes: int = 2
    # The formula's coefficients, worked out once: a step's cost is then a few multiplications (the
    # simulator asks for one every step of every engine).
    kv_bytes_per_token_per_gpu: int = field(init=False)
    weight_bytes_per_gpu: float = field(init=False)
    _token_compute_s: float = field(init=False, repr=False)
    _pair_compute_s: float = field(init=False, repr=False)
    _weights_s: float = field(init=False, repr=False)
    _kv_token_s: float = field(init=False, repr=False)
    _allreduce_s: float = field(init=False, repr=False)
    _allreduce_token_s: float = field(init=False, repr=False)
    _attention_read: float = field(init=False, repr=False)  # s: 1.0 when attention reads at the GEMV's share

    def __post_init__(self) -> None:
        m, g, tp = self.model, self.gpu, self.tp
        flops_s, bytes_s = tp * g.peak_flops * g.mfu, g.hbm_bytes_s * g.hbm_efficiency
        kv = m.layers * 2 * m.kv_heads_per_gpu(tp) * m.head_dim * self.dtype_bytes
        weights = m.step_params * self.dtype_bytes / tp
        ring = 0.0 if tp == 1 else m.hidden * self.dtype_bytes * 2 * (tp - 1) / tp / g.allreduce_busbw
        for name, value in (("kv_bytes_per_token_per_gpu", kv), ("weight_bytes_per_gpu", weights),
                            ("_token_compute_s", 2 * m.linear_params / flops_s),
                            ("_pair_compute_s", 4 * m.layers * m.heads * m.head_dim / flops_s),
                            ("_weights_s", weights / bytes_s), ("_kv_token_s", kv / bytes_s),
                            ("_allreduce_s", 0.0 if tp == 1 else 2 * m.layers * g.allreduce_latency_s),
                            ("_allreduce_token_s", 2 * m.layers * ring),
                            ("_attention_read", 1.0 if g.decode_attention_efficiency is None
                             else g.hbm_efficiency / g.decode_attention_efficiency)):
            object.__setattr__(self, name, value)

    def seconds(self, prefill_tokens: int, decode_tokens: int, decode_context: int, prefill_context: int,
                prefill_sequences: int = 0, staged_bytes: float = 0) -> float:
        # compute_s, memory_s and allreduce_s written out, in their operation order (the same floats):
        # the simulator calls this every step of every engine. A roof has no per-sequence term: a GPU
        # kernel takes a step's prompts together (prefill_sequences is StepCost's, sim/step_cost.py),
        # and no staged bytes' term: its copy engines move them beside the compute (staging_time.py).
        tokens = prefill_tokens + decode_tokens
        compute = self._token_compute_s * tokens + self._pair_compute_s * (decode_context + prefill_context)
        memory = self._weights_s + self._kv_token_s * (decode_context * self._attention_read + tokens)
        return self.gpu.overhead_s + (compute if compute > memory else memory) + \
            (self._allreduce_s + self._allreduce_token_s * tokens)

    def compute_s(self, tokens: int, pairs: int) -> float:
        return self._token_compute_s * tokens + self._pair_compute_s * pairs

    def memory_s(self, tokens: int, kv_read: int) -> float:
        return self._weights_s + self._kv_token_s * (kv_read * self._attention_read + tokens)

    def allreduce_s(self, tokens: int) -> float:
        return self._allreduce_s + self._allreduce_token_s * tokens


DTYPE_BYTES = {"float16": 2, "bfloat16": 2}


def gpu(constants: dict) -> GPU:
    """A profile's GPU from its `constants` (each {"value", "source"}; units in the names)."""
    value = {name: float(entry["value"]) for name, entry in constants.items()}
    return GPU(peak_flops=value["peak_tflops"] * 1e12, hbm_bytes_s=value["hbm_gbs"] * 1e9, mfu=value["mfu"],
               hbm_efficiency=value["hbm_efficiency"], allreduce_busbw=value["allreduce_busbw_gbs"] * 1e9,
               allreduce_latency_s=value["allreduce_latency_us"] * 1e-6, overhead_s=value["overhead_us"] * 1e-6,
               decode_attention_efficiency=value.get("decode_attention_efficiency"))


def from_profile(body: dict) -> Roofline:
    """The roofline a profile (kind "roofline") describes."""
    return Roofline(MODELS[body["model"]], gpu(body["constants"]), int(body["tp"]), DTYPE_BYTES[body["dtype"]])
