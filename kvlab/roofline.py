"""The bytes-per-step model of decoding, and the ceilings it is judged against.

A decode step streams every weight once and, for each sequence in the batch, every cached K/V byte once:

    TPOT ~= (weight bytes + batch * KV bytes per sequence) / memory bandwidth

Two figures for the weights, on purpose:
- ``weight_bytes``: all parameters times their size. This is what a checkpoint weighs and what memory must hold,
  and what the course's worked examples (and most published estimates) use.
- ``weight_bytes_read``: what one step really reads. An untied input embedding is a lookup table: a step reads
  one row per sequence, not the whole matrix (for Llama-3.1-8B that is 1 GB of 16 GB not read). A
  mixture-of-experts step reads only the experts it routes to (``n_active_params``, exact at batch 1; a larger
  batch routes to more experts, up to all of them). A tied embedding is read in full anyway, as the output head.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from kvlab.config import ModelConfig
from kvlab.device import resolve_device, synchronize
from kvlab.dtypes import bytes_per_element, canonical_dtype, torch_dtype
from kvlab.validation import require_int


# -- parameter and byte counts ------------------------------------------------------------------------------------
def param_count(cfg: ModelConfig) -> int:
    """All parameters: the published count where the config carries one, else counted from the shape."""
    if cfg.n_params is not None:
        return cfg.n_params
    return _embedding_params(cfg) * (1 if cfg.tie_embeddings else 2) + cfg.n_layers * _layer_params(cfg) + cfg.d_model


def _embedding_params(cfg: ModelConfig) -> int:
    return cfg.vocab_size * cfg.d_model


def _layer_params(cfg: ModelConfig) -> int:
    d, h = cfg.d_model, cfg.n_heads
    if cfg.mla is None:
        attention = 2 * d * h * cfg.head_dim + 2 * d * cfg.n_kv_heads * cfg.head_dim
    else:
        m = cfg.mla
        qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = d * h * qk_dim if m.q_lora_rank is None else d * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * h * qk_dim
        kv = (
            d * (m.kv_lora_rank + m.qk_rope_head_dim)
            + m.kv_lora_rank
            + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim)
        )
        attention = q + kv + h * m.v_head_dim * d
    return attention + 3 * d * cfg.d_ff + 2 * d


def weight_bytes(cfg: ModelConfig, weight_dtype: str | None = None) -> int:
    """Bytes of all parameters (see the module docstring for why this is not what a step reads)."""
    return round(param_count(cfg) * bytes_per_element(weight_dtype or cfg.dtype, "weight_dtype"))


def weight_bytes_read(cfg: ModelConfig, weight_dtype: str | None = None, batch: int = 1) -> int:
    """Bytes of weights one decode step reads: untied input embeddings contribute one row per sequence."""
    require_int("batch", batch)
    size = bytes_per_element(weight_dtype or cfg.dtype, "weight_dtype")
    params = cfg.n_active_params if cfg.n_active_params is not None else param_count(cfg)
    if not cfg.tie_embeddings:
        params -= _embedding_params(cfg) - min(batch, cfg.vocab_size) * cfg.d_model
    return round(params * size)


def kv_elements_per_token_per_layer(cfg: ModelConfig) -> int:
    """Elements one token caches in one layer: K and V for each KV head, or MLA's one latent."""
    if cfg.mla is not None:
        return cfg.mla.cached_elements_per_layer
    return 2 * cfg.n_kv_heads * cfg.head_dim


def kv_element_bytes(kv_dtype: str, group_size: int | None = None) -> float:
    """Bytes per cached element: the payload, plus, with ``group_size``, the scale (and zero point) that each group
    of that many elements shares, as kvlab's codecs store them (KIVI grouping: keys per channel, values per token,
    one set of statistics per ``group_size`` elements either way). A full-precision residual window is not counted.
    """
    if group_size is None:
        return bytes_per_element(kv_dtype, "kv_dtype")
    require_int("group_size", group_size)
    from kvlab.cache.codecs import get_codec  # the codecs are the one place that knows the stored layout

    return get_codec(canonical_dtype(kv_dtype, "kv_dtype")).stored_bytes((group_size,), 0, group_size) / group_size


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str | None = None, group_size: int | None = None) -> int:
    """Bytes one token of one sequence caches across all layers: 2 x layers x KV heads x head dim x bytes."""
    size = kv_element_bytes(kv_dtype or cfg.dtype, group_size)
    return round(cfg.n_layers * kv_elements_per_token_per_layer(cfg) * size)


@dataclass(frozen=True)
class TokensRead:
    """Token-layers one decode step reads: ``shared`` once for the whole batch, ``per_sequence`` for each sequence."""

    shared: int
    per_sequence: int


def kv_tokens_read(
    cfg: ModelConfig, context: int, window: int | None = None, sinks: int = 0, shared_prefix: int = 0
) -> TokensRead:
    """Which cached tokens each layer reads at ``context`` tokens, summed over layers.

    - A local layer of the model (``cfg.layer_windows``) reads at most its own window.
    - A ``window`` + ``sinks`` policy keeps the first ``sinks`` tokens and the ``window`` most recent ones.
    - The first ``shared_prefix`` tokens are shared by every sequence in the batch; a shared-prefix (cascade)
      kernel reads the ones a layer keeps once per step, not once per sequence.
    """
    require_int("context", context, 0)
    if window is not None:
        require_int("window", window)
    require_int("sinks", sinks, 0)
    require_int("shared_prefix", shared_prefix, 0)
    if sinks and window is None:
        raise ValueError("sinks: only meaningful with a window; allowed: give window too, or sinks=0")
    if shared_prefix > context:
        raise ValueError(f"shared_prefix: {shared_prefix}; allowed: at most the context ({context})")
    shared = per_sequence = 0
    for layer_window in cfg.layer_windows or (None,) * cfg.n_layers:
        for start, end in _kept_intervals(context, layer_window, window, sinks):
            in_prefix = max(0, min(end, shared_prefix) - start)
            shared += in_prefix
            per_sequence += end - start - in_prefix
    return TokensRead(shared, per_sequence)


def _kept_intervals(context: int, layer_window: int | None, window: int | None, sinks: int) -> list[tuple[int, int]]:
    """Half-open position ranges one layer keeps: sinks and recent window, clipped to the layer's own window."""
    if window is None:
        kept = [(0, context)]
    else:
        head = min(sinks, context)
        kept = [(0, head), (max(head, context - window), context)]
    if layer_window is not None:
        kept = [(max(start, context - layer_window), end) for start, end in kept]
    return [(start, end) for start, end in kept if end > start]


def kv_bytes_per_step(
    cfg: ModelConfig,
    context: int,
    batch: int = 1,
    kv_dtype: str | None = None,
    window: int | None = None,
    sinks: int = 0,
    shared_prefix: int = 0,
    group_size: int | None = None,
) -> int:
    """KV bytes one decode step reads for the whole batch, each sequence attending over ``context`` tokens.

    Honours the model's local layers, a ``window`` + ``sinks`` policy, and a ``shared_prefix`` read once per batch
    (see ``kv_tokens_read``).
    """
    require_int("batch", batch)
    size = kv_element_bytes(kv_dtype or cfg.dtype, group_size)
    tokens = kv_tokens_read(cfg, context, window, sinks, shared_prefix)
    return round((tokens.shared + batch * tokens.per_sequence) * kv_elements_per_token_per_layer(cfg) * size)


def bytes_per_step(
    cfg: ModelConfig, context: int, batch: int = 1, weight_dtype: str | None = None, kv_dtype: str | None = None
) -> int:
    """Weight bytes (all parameters) plus the KV bytes the step reads for the whole batch."""
    return weight_bytes(cfg, weight_dtype) + kv_bytes_per_step(cfg, context, batch, kv_dtype)


def predict_tpot_ms(n_bytes: float, bandwidth_gbps: float) -> float:
    """Lower bound on time per output token: bytes streamed / bandwidth (GB/s = 1e9 bytes/s), in ms."""
    if not bandwidth_gbps > 0:
        raise ValueError(f"bandwidth: {bandwidth_gbps!r}; allowed: a number of GB/s > 0")
    return n_bytes / (bandwidth_gbps * 1e9) * 1e3


@dataclass(frozen=True)
class Prediction:
    """One decode step's bytes and predicted TPOT. Bytes are exact integers; GB means 1e9 bytes."""

    model: str
    context: int
    batch: int
    weight_dtype: str
    kv_dtype: str
    window: int | None
    sinks: int
    shared_prefix: int
    group_size: int | None
    bandwidth_gbps: float
    weight_bytes: int
    weight_bytes_read: int
    kv_bytes_per_token: int
    kv_bytes: int
    bytes_per_step: int
    tpot_ms: float
    tpot_ms_weights_only: float

    def to_dict(self) -> dict:
        return asdict(self)


def predict(
    cfg: ModelConfig,
    context: int,
    bandwidth_gbps: float,
    batch: int = 1,
    weight_dtype: str | None = None,
    kv_dtype: str | None = None,
    window: int | None = None,
    sinks: int = 0,
    shared_prefix: int = 0,
    group_size: int | None = None,
) -> Prediction:
    """The whole breakdown for one step at ``context`` tokens and ``batch`` sequences (see ``kv_tokens_read``)."""
    weight_dtype = canonical_dtype(weight_dtype or cfg.dtype, "weight_dtype")
    kv_dtype = canonical_dtype(kv_dtype or cfg.dtype, "kv_dtype")
    w = weight_bytes(cfg, weight_dtype)
    kv = kv_bytes_per_step(cfg, context, batch, kv_dtype, window, sinks, shared_prefix, group_size)
    return Prediction(
        model=cfg.name,
        context=context,
        batch=batch,
        weight_dtype=weight_dtype,
        kv_dtype=kv_dtype,
        window=window,
        sinks=sinks,
        shared_prefix=shared_prefix,
        group_size=group_size,
        bandwidth_gbps=bandwidth_gbps,
        weight_bytes=w,
        weight_bytes_read=weight_bytes_read(cfg, weight_dtype, batch),
        kv_bytes_per_token=kv_bytes_per_token(cfg, kv_dtype, group_size),
        kv_bytes=kv,
        bytes_per_step=w + kv,
        tpot_ms=predict_tpot_ms(w + kv, bandwidth_gbps),
        tpot_ms_weights_only=predict_tpot_ms(w, bandwidth_gbps),
    )


# -- measured ceilings --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bandwidth:
    """Measured memory bandwidth in GB/s (1e9 bytes/s): median over repeats, and the best repeat."""

    device: str
    size_mb: float
    copy_gbps: float
    read_gbps: float
    copy_best_gbps: float
    read_best_gbps: float


def _time_repeats(fn, device: torch.device, repeats: int) -> list[float]:
    """Seconds per call, each call timed on its own (CUDA events on GPU, a monotonic clock on CPU)."""
    fn()  # warm-up: first touch of fresh pages and kernel selection are not bandwidth
    synchronize(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def measure_bandwidth(device: str | torch.device | None = None, size_mb: float = 256, repeats: int = 10) -> Bandwidth:
    """Copy bandwidth (read + write both counted) and read bandwidth (a sum) over a ``size_mb`` fp32 buffer.

    The buffer should be much larger than the last-level cache, or the figure measures the cache, not memory.
    """
    device = resolve_device(device)
    n = int(size_mb * 1e6 / 4)
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    copy = _time_repeats(lambda: dst.copy_(src), device, repeats)
    read = _time_repeats(lambda: src.sum(), device, repeats)
    return Bandwidth(
        device=str(device),
        size_mb=nbytes / 1e6,
        copy_gbps=2 * nbytes / statistics.median(copy) / 1e9,
        read_gbps=nbytes / statistics.median(read) / 1e9,
        copy_best_gbps=2 * nbytes / min(copy) / 1e9,
        read_best_gbps=nbytes / min(read) / 1e9,
    )


def measure_matmul_flops(
    device: str | torch.device | None = None, n: int = 1024, dtype: str | None = None, repeats: int = 5
) -> float:
    """Dense matmul throughput in FLOP/s for ``n x n`` operands (2 n^3 FLOPs each); bf16 on GPU, fp32 on CPU."""
    device = resolve_device(device)
    tdtype = torch_dtype(dtype or ("bf16" if device.type == "cuda" else "fp32"))
    a = torch.randn(n, n, device=device, dtype=tdtype)
    b = torch.randn(n, n, device=device, dtype=tdtype)
    times = _time_repeats(lambda: a @ b, device, repeats)
    return 2 * n**3 / statistics.median(times)
