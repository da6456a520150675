"""FLOPs of a decode and a prefill step, and the roofline they meet the bytes on: arithmetic only, no torch.

The ceilings are measured by ``kvlab.machine`` (matmul FLOP/s, bandwidth), or come from datasheets
(``kvlab.spec.presets``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.roofline.bytes import active_params
from kvlab.spec.config import ModelConfig
from kvlab.spec.validation import require_int


def decode_attention_flops(n_layers: int, q_width: int, context: int) -> int:
    """FLOPs (2 per multiply-add) of one new token's attention over ``context`` cached tokens, one sequence:
    ``4 x n_layers x q_width x context``, where ``q_width`` is query heads x head dim (q.K and p.V, 2 FLOPs per
    multiply-add each). GQA shares K and V across query heads, not these multiplies."""
    return 4 * n_layers * q_width * context


def decode_flops(cfg: ModelConfig, context: int, batch: int = 1) -> int:
    """FLOPs of one decode step: 2 per parameter a token uses, per sequence, plus attention's 4 x context x heads
    x head dim per layer (``decode_attention_flops``). Dense attention only (MLA: ``mla_attention_flops``).

    The parameters a token uses are ``active_params(cfg)`` at batch 1: all of a dense model's, and for a mixture of
    experts the dense parts plus the ``top_k`` routed and the shared experts. Each sequence multiplies by its own
    experts only, so FLOPs scale with batch x per-token parameters, even where the batch as a whole reads more
    experts' bytes (``active_params(cfg, batch)``). Every parameter counts 2, the untied input table included
    (lesson 02 says why).
    """
    attention = decode_attention_flops(cfg.n_layers, cfg.n_heads * cfg.head_dim, context)
    return batch * (2 * active_params(cfg) + attention)


def prefill_flops(cfg: ModelConfig, n_tokens: int) -> int:
    """FLOPs of a causal prefill of ``n_tokens`` (one sequence): token t attends over t keys, so attention sums to
    2 x layers x heads x head dim x T (T + 1), which is of order 2 T^2 d per layer."""
    attention = 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * n_tokens * (n_tokens + 1)
    return 2 * active_params(cfg) * n_tokens + attention


def ridge_intensity(peak_flops_per_s: float, bandwidth_gbps: float) -> float:
    """The roofline's ridge point in FLOPs per byte: where compute time equals memory time,
    peak FLOP/s / (bandwidth in bytes/s, GB/s = 1e9 bytes/s)."""
    return peak_flops_per_s / (bandwidth_gbps * 1e9)


def roofline_time_ms(flops: float, n_bytes: float, peak_flops_per_s: float, bandwidth_gbps: float) -> float:
    """The roofline's time for a step, in ms: the slower of FLOPs / peak and bytes / bandwidth (not their sum)."""
    return max(flops / peak_flops_per_s, n_bytes / (bandwidth_gbps * 1e9)) * 1e3


def batch_for_tpot(
    target_ms: float, weight_bytes: float, kv_bytes_per_token: float, context: int, bandwidth_gbps: float
) -> float:
    """The batch (sequences) at which the byte model reaches ``target_ms`` per step, with ``weight_bytes`` read once
    and ``kv_bytes_per_token`` per cached token of each sequence at ``context`` tokens, at ``bandwidth_gbps``
    (GB/s). Fractional: the model is linear in batch."""
    return (target_ms / 1e3 * bandwidth_gbps * 1e9 - weight_bytes) / (context * kv_bytes_per_token)


def crossover_context(weight_bytes: float, kv_bytes_per_token: float, batch: int = 1) -> float:
    """Context (tokens, fractional) at which a step's KV bytes for ``batch`` sequences equal its weight bytes."""
    return weight_bytes / (batch * kv_bytes_per_token)


@dataclass(frozen=True)
class MLAAttentionFlops:
    """FLOPs (2 per multiply-add) of one layer's attention for one new token over ``context`` tokens, by part.

    Elementwise work (softmax, RoPE, norms) is left out: it is small beside these products.
    """

    context: int
    projections: int  # both paths: x -> query and latent (q up-projection too with q_lora_rank), and the output
    expand: int  # naive: up-project every cached latent to per-head K and V, 2 S r H (n + v)
    attend_expanded: int  # naive: q.K and p.V over per-head K/V, 2 S H (n + p + v)
    absorb: int  # absorbed: fold W_uk into the query and apply W_uv to the result, 2 H r (n + v), once per token
    attend_latent: int  # absorbed: scores against [c_kv | k_rope] and the weighted sum of c_kv, 2 S H (2 r + p)

    @property
    def naive(self) -> int:
        return self.projections + self.expand + self.attend_expanded

    @property
    def absorbed(self) -> int:
        return self.projections + self.absorb + self.attend_latent

    @property
    def absorption_extra(self) -> int:
        """What absorption costs beyond attention over per-head K/V, as MHA with a full cache would compute it."""
        return self.absorb + self.attend_latent - self.attend_expanded


def mla_attention_flops(cfg: ModelConfig, context: int) -> MLAAttentionFlops:
    """FLOPs of one decode token's attention in one MLA layer, attending over ``context`` tokens, both paths.

    For DeepSeek-V3 (H 128, r 512, p 64, n 128, v 128) each attended token costs 278,528 FLOPs absorbed against
    81,920 over per-head K/V (3.4x), in exchange for reading 576 cached elements instead of 40,960; the naive path
    spends 33,554,432 FLOPs per token re-expanding it (at 4,096 tokens: 138.1 GFLOP per layer naive, 1.52 absorbed).
    In bf16, absorbed attention does about 242 FLOPs per cached byte it reads (MHA: 1), above an H200's datasheet
    ratio of dense FLOP/s to bandwidth (989e12 / 4.8e12 = 206): on paper that part of the step is bound by compute,
    not by the bytes it reads.
    """
    m = cfg.mla
    if m is None:
        raise ValueError(f"cfg: {cfg.name} has no MLA shape; allowed: a config with mla=MLAConfig(...)")
    require_int("context", context, 1, note="the new token attends to itself")
    h, r, p, n, v = cfg.n_heads, m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim
    q_in = m.q_lora_rank or h * (n + p)
    projections = 2 * cfg.d_model * (q_in + r + p) + 2 * h * v * cfg.d_model
    if m.q_lora_rank is not None:
        projections += 2 * m.q_lora_rank * h * (n + p)
    return MLAAttentionFlops(
        context=context,
        projections=projections,
        expand=2 * context * r * h * (n + v),
        attend_expanded=2 * context * h * (n + p + v),
        absorb=2 * h * r * (n + v),
        attend_latent=2 * context * h * (2 * r + p),
    )
