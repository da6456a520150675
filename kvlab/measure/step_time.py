"""Where one decode step's time goes: weight matvecs, attention over the KV cache, and everything else.

Each part is set against the same bytes streamed read-only at the same thread count, two ways: ``stream`` sums
the very tensors the part reads, in the same order (what reading those bytes costs here, caches included), and
``predicted`` divides the part's bytes by the read bandwidth of a buffer larger than the last-level cache (the
byte model's ceiling). Attention is also split into its two products, q·K (reads K) and p·V (reads V), each
timed alone. ``rest`` is the whole step minus the matvecs and the attention: norms, RoPE, the cache
append, the embedding lookup, and Python and dispatch overhead, none of which the byte model counts.

All parts are measured in one process, one repeat of each in turn, and the medians over repeats are reported, so
a burst of load from elsewhere slows every part alike. ``python benchmarks/decode_breakdown.py`` runs it from the
command line; lesson 02 runs it on the course's model.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from kvlab.machine.timing import bandwidth_buffer_mb, require_clock, time_interleaved
from kvlab.model.decoder import Decoder
from kvlab.roofline import predict_tpot_ms


def layer_weights(model: Decoder) -> list[list[torch.Tensor]]:
    """Each layer's projection weights in the order a step applies them, then the output head as a last 'layer'."""
    layers = [[b.attn.wqkv, b.attn.wo, b.mlp.w_gate_up, b.mlp.w_down] for b in model.layers]
    head = model.embed.weight.T if model.lm_head is None else model.lm_head
    return [*layers, [head]]


@torch.inference_mode()
def breakdown(
    model: Decoder, context: int, repeats: int, clock: str = "wall", buffer_mb: float | None = None, warmup: int = 3
) -> dict:
    """Median ms per part of a decode step at ``context`` tokens, and the bytes each part reads.

    The read and copy bandwidth probes (``buffer_mb``, default ``bandwidth_buffer_mb()``) run in the same loop
    with the same clock, so that the prediction shares the parts' machine state.

    ``clock="thread"`` counts only the CPU time of this thread, so that time spent descheduled on a loaded
    machine does not count; it sees only one thread's work, so it needs ``torch.get_num_threads() == 1``.
    Totals are medians of each repeat's sum, so they cover as long a stretch of time as the whole step does.
    """
    require_clock(clock)
    if clock == "thread" and torch.get_num_threads() != 1:
        raise ValueError(f"clock: 'thread' counts one thread, torch uses {torch.get_num_threads()}; allowed: 1")
    if model.device.type != "cpu":
        raise ValueError(
            f"model: on {model.device}; allowed: a model on the CPU (the parts are timed with a host clock)"
        )
    cfg = model.cfg
    if cfg.mla is not None or cfg.layer_windows is not None:
        raise ValueError(f"preset: {cfg.name} has MLA or local layers; allowed: a model with global MHA/GQA layers")
    cache = model.new_cache(1, context + warmup + repeats)
    cache.fast_fill(context - 1, generator=torch.Generator().manual_seed(0))
    weights = layer_weights(model)
    # Activations of the right width; their values do not change a matvec's time.
    inputs = [[torch.randn(1, w.shape[0]) for w in layer] for layer in weights]
    # one new token's queries, grouped by the KV head they share: [B, Hkv, G, T, D] (model.attention.group_queries)
    groups = cfg.n_heads // cfg.n_kv_heads
    q = torch.randn(1, cfg.n_kv_heads, groups, 1, cfg.head_dim)
    # attention's two products on their own: q·K over the key-major keys, then p·V (see kvlab.kernels.reference)
    q_grouped = q[:, :, :, 0]
    probs = torch.softmax(torch.randn(1, cfg.n_kv_heads, groups, cache.capacity), dim=-1)
    token = torch.zeros(1, dtype=torch.long)
    src = torch.randn(int((buffer_mb or bandwidth_buffer_mb()) * 1e6 / 4))
    dst = torch.empty_like(src)

    def matvecs(i: int) -> Callable[[], object]:
        return lambda: [x @ w for x, w in zip(inputs[i], weights[i], strict=True)]

    def weight_stream(i: int) -> Callable[[], object]:
        return lambda: [w.sum() for w in weights[i]]

    def attention(layer: int) -> Callable[[], object]:
        return lambda: cache.attend(layer, q)

    def kv_stream(layer: int) -> Callable[[], object]:
        return lambda: [t.sum() for t in cache.read(layer)]

    def scores(layer: int) -> Callable[[], object]:
        return lambda: q_grouped @ cache.read(layer)[0].transpose(-1, -2)

    def weighted_values(layer: int) -> Callable[[], object]:
        return lambda: probs[..., : cache.length] @ cache.read(layer)[1]

    def one_stream(layer: int, which: int) -> Callable[[], object]:
        return lambda: cache.read(layer)[which].sum()

    parts: dict[str, list[Callable[[], object]]] = {
        "step": [lambda: model.decode_step(token, cache)],
        "read_probe": [src.sum],
        "copy_probe": [lambda: dst.copy_(src)],
        "matvec": [matvecs(i) for i in range(len(weights))],
        "matvec_stream": [weight_stream(i) for i in range(len(weights))],
        "attention": [attention(i) for i in range(cfg.n_layers)],
        "attention_stream": [kv_stream(i) for i in range(cfg.n_layers)],
        "scores": [scores(i) for i in range(cfg.n_layers)],
        "k_stream": [one_stream(i, 0) for i in range(cfg.n_layers)],
        "values": [weighted_values(i) for i in range(cfg.n_layers)],
        "v_stream": [one_stream(i, 1) for i in range(cfg.n_layers)],
    }
    flat = {(name, i): fn for name, fns in parts.items() for i, fn in enumerate(fns)}
    seconds = time_interleaved(flat, repeats, warmup, model.device, clock)
    times = {name: [[t * 1e3 for t in seconds[name, i]] for i in range(len(fns))] for name, fns in parts.items()}
    # Repeat r attends over context + r tokens (each step appends one): count the bytes at the median timed repeat.
    kv_context = context + warmup + (repeats - 1) // 2
    kv_layer_bytes = cache.bytes_read_per_step(kv_context) // cfg.n_layers
    probe_bytes = src.numel() * src.element_size()
    return {
        "read_gbps": probe_bytes / statistics.median(times["read_probe"][0]) / 1e6,
        "copy_gbps": 2 * probe_bytes / statistics.median(times["copy_probe"][0]) / 1e6,
        "buffer_mb": probe_bytes / 1e6,
        "context": context,
        "context_end": cache.length,
        "kv_context": kv_context,
        "clock": clock,
        "weight_bytes": [sum(w.numel() * w.element_size() for w in layer) for layer in weights],
        "kv_bytes": [kv_layer_bytes] * cfg.n_layers,
        "ms": {name: [statistics.median(t) for t in per] for name, per in times.items()},
        "total_ms": {name: statistics.median(map(sum, zip(*per, strict=True))) for name, per in times.items()},
    }


def breakdown_table(result: dict) -> list[str]:
    """The table ``main`` prints: per layer, then totals, measured against the read-only stream and the model."""
    ms, total, wb, kb = result["ms"], result["total_ms"], result["weight_bytes"], result["kv_bytes"]
    head = f"{'part':<26} {'MB':>8} {'measured ms':>12} {'stream ms':>10} {'predicted ms':>13} {'GB/s':>6}"
    head += f" {'x pred':>7}"

    def row(name: str, n_bytes: float, measured: float, stream: float | None) -> str:
        predicted = predict_tpot_ms(n_bytes, result["read_gbps"])
        s = f"{stream:>10.3f}" if stream is not None else f"{'':>10}"
        rate = f"{n_bytes / measured / 1e6:>6.1f}" if n_bytes else f"{'':>6}"
        ratio = f"{measured / predicted:>7.2f}" if n_bytes else f"{'':>7}"
        pred = f"{predicted:>13.3f}" if n_bytes else f"{'':>13}"
        return f"{name:<26} {n_bytes / 1e6:>8.2f} {measured:>12.3f} {s} {pred} {rate} {ratio}"

    n_layers = len(kb)
    lines = [head]
    for i in range(n_layers):
        lines.append(row(f"layer {i} matvecs", wb[i], ms["matvec"][i], ms["matvec_stream"][i]))
    lines.append(row("output head matvec", wb[-1], ms["matvec"][-1], ms["matvec_stream"][-1]))
    for i in range(n_layers):
        lines.append(row(f"layer {i} attention", kb[i], ms["attention"][i], ms["attention_stream"][i]))
    matvec, attention, step = total["matvec"], total["attention"], total["step"]
    lines += [
        row("all weight matvecs", sum(wb), matvec, total["matvec_stream"]),
        row("all attention (KV)", sum(kb), attention, total["attention_stream"]),
        row("  of which q·K (K only)", sum(kb) / 2, total["scores"], total["k_stream"]),
        row("  of which p·V (V only)", sum(kb) / 2, total["values"], total["v_stream"]),
        row("rest (norms, RoPE, ...)", 0, step - matvec - attention, None),
        row("decode step", sum(wb) + sum(kb), step, total["matvec_stream"] + total["attention_stream"]),
    ]
    return lines
