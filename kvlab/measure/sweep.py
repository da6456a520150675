"""Timing requests on this machine, and context sweeps: TPOT measured against the byte model's prediction.

The latency definitions (vLLM's) and the line fit are ``kvlab.metrics``'.

Timing rules: warm up before measuring (first calls pay for allocation and kernel selection); synchronize the
device before reading a clock (CUDA events on GPU, where launches are asynchronous: ``kvlab.machine.timing.Stopwatch``
does both); report percentiles, not one run, because a shared machine's timings have a long tail.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

from kvlab.cache.base import CacheFactory, KVCache, default_cache
from kvlab.machine.timing import Bandwidth, Stopwatch, machine_info, measure_bandwidth
from kvlab.metrics import Fit, RequestTiming, fit_line, latency_summaries, percentile
from kvlab.model.decoder import Decoder
from kvlab.roofline import predict_tpot_ms, weight_bytes_read

K = TypeVar("K", bound=Hashable)  # the key naming an arm of an interleaved sweep


@torch.inference_mode()
def time_request(model: Decoder, cache: KVCache, n_tokens: int, prompt: torch.Tensor | None = None) -> RequestTiming:
    """Time one greedy request of ``n_tokens`` output tokens.

    With a ``prompt`` ``[B, T]``, the request starts with its prefill (TTFT includes it). Without one, the cache
    is taken as already holding the context (see ``ContiguousKVCache.fast_fill``), and the first output token
    costs one decode step.
    """
    if n_tokens < 1:
        raise ValueError(f"n_tokens: {n_tokens}; allowed: an integer >= 1")
    tokens = torch.zeros(cache.batch_size, dtype=torch.long, device=model.device)
    clock = Stopwatch(model.device)
    logits = model.prefill(prompt, cache)[:, -1] if prompt is not None else model.decode_step(tokens, cache)
    tokens = logits.argmax(-1)
    clock.mark()
    for _ in range(n_tokens - 1):
        tokens = model.decode_step(tokens, cache).argmax(-1)
        clock.mark()
    return RequestTiming(clock.times_s())


# -- context sweep -----------------------------------------------------------------------------------------------
@dataclass
class SweepPoint:
    """All requests measured at one context length, with vLLM-named summaries and the byte-model prediction."""

    context: int
    batch: int
    requests: list[RequestTiming] = field(repr=False)
    bytes_per_step: int
    predicted_tpot_ms: float

    def metrics(self) -> dict[str, float]:
        return latency_summaries(self.requests)

    @property
    def tpot_ms(self) -> float:
        """The point's TPOT: the median over its requests (robust to one disturbed request)."""
        return percentile([r.tpot_ms for r in self.requests], 50)


@dataclass
class Sweep:
    """TPOT against context for one model, with the fit and the prediction from bandwidth measured in the same run."""

    model: str
    device: str
    batch: int
    fill: str
    bandwidth: Bandwidth
    kv_bytes_per_token: float
    weight_bytes_read: int
    points: list[SweepPoint]
    runtime: str = "eager"  # what ran the decode steps: Decoder.runtime
    weight_dtype: str = "fp32"  # the precision the steps read the weights in: Decoder.weight_dtype

    @property
    def fit(self) -> Fit:
        """TPOT (ms) against context (tokens); a sweep of one context has no line (``ValueError``)."""
        if len(self.points) < 2:
            raise ValueError(
                f"contexts: one ({self.points[0].context}); a slope and an intercept need at least two contexts"
            )
        return fit_line([p.context for p in self.points], [p.tpot_ms for p in self.points])

    @property
    def predicted_slope_us_per_token(self) -> float:
        """Extra time per extra token of context if the KV bytes streamed at the measured read bandwidth."""
        return predict_tpot_ms(self.batch * self.kv_bytes_per_token, self.bandwidth.read_gbps) * 1e3

    @property
    def predicted_intercept_ms(self) -> float:
        """Time to stream the weights one step reads at the measured read bandwidth."""
        return predict_tpot_ms(self.weight_bytes_read, self.bandwidth.read_gbps)

    def summary(self) -> dict[str, float]:
        """The fit next to the prediction, and the share of the read bandwidth each term reached; with one context
        there is no line, and only the predictions are given."""
        predicted = {
            "predicted_slope_us_per_token": self.predicted_slope_us_per_token,
            "predicted_intercept_ms": self.predicted_intercept_ms,
        }
        if len(self.points) < 2:
            return predicted
        fit = self.fit
        slope_us = fit.slope * 1e3
        return {
            "r2": fit.r2,
            "slope_us_per_token": slope_us,
            "intercept_ms": fit.intercept,
            "predicted_slope_us_per_token": self.predicted_slope_us_per_token,
            "predicted_intercept_ms": self.predicted_intercept_ms,
            "kv_bandwidth_fraction": self.predicted_slope_us_per_token / slope_us if slope_us > 0 else float("nan"),
            "weight_bandwidth_fraction": self.predicted_intercept_ms / fit.intercept
            if fit.intercept > 0
            else float("nan"),
        }

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "device": self.device,
            "batch": self.batch,
            "fill": self.fill,
            "runtime": self.runtime,
            "weight_dtype": self.weight_dtype,
            "environment": machine_info(),
            "bandwidth": asdict(self.bandwidth),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "weight_bytes_read": self.weight_bytes_read,
            "fit": self.summary(),
            "points": [
                {
                    "context": p.context,
                    "batch": p.batch,
                    "n_requests": len(p.requests),
                    "output_len": len(p.requests[0].token_times_s),
                    "tpot_ms": p.tpot_ms,
                    "bytes_per_step": p.bytes_per_step,
                    "predicted_tpot_ms": p.predicted_tpot_ms,
                    **p.metrics(),
                }
                for p in self.points
            ],
        }

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    def plot(self, path: str | Path | None = None, ax=None):
        """Measured TPOT (median, with the p90 above it) against the bytes / bandwidth prediction."""
        import matplotlib

        if ax is None and path is not None:
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(7, 4.5))
        ctx = [p.context for p in self.points]
        med = [p.tpot_ms for p in self.points]
        p90 = [p.metrics()["p90_tpot_ms"] for p in self.points]
        ax.errorbar(
            ctx,
            med,
            yerr=[[0] * len(med), [b - a for a, b in zip(med, p90, strict=True)]],
            fmt="o",
            capsize=3,
            label="measured TPOT (median, bar to p90)",
        )
        if len(self.points) >= 2:
            fit = self.fit
            ax.plot(
                ctx,
                [fit.slope * c + fit.intercept for c in ctx],
                "-",
                alpha=0.6,
                label=f"fit: {fit.slope * 1e3:.2f} µs/token, R²={fit.r2:.3f}",
            )
        ax.plot(
            ctx,
            [p.predicted_tpot_ms for p in self.points],
            "--",
            label=f"predicted: bytes / {self.bandwidth.read_gbps:.0f} GB/s measured read",
        )
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("time per output token (ms)")
        ax.set_title(f"{self.model}, batch {self.batch}, on {self.device}: TPOT grows with the KV cache")
        ax.set_ylim(bottom=0)
        ax.legend()
        ax.grid(alpha=0.3)
        if path is not None:
            ax.figure.tight_layout()
            ax.figure.savefig(path, dpi=120)
        return ax


@dataclass(frozen=True)
class Arm:
    """One of the things an interleaved sweep times: a model, the cache it decodes with (``None``: the model's
    default cache), and the batch of sequences each request decodes."""

    model: Decoder
    make_cache: CacheFactory | None = None
    batch: int = 1


def interleaved_sweeps(
    arms: Mapping[K, Arm],
    contexts: Sequence[int],
    n_tokens: int = 16,
    n_requests: int = 3,
    fill: str = "fast",
    warmup_steps: int = 3,
    bandwidth: Bandwidth | None = None,
    progress: bool = True,
) -> dict[K, Sweep]:
    """One ``Sweep`` per arm: TPOT at each context length, ``n_requests`` requests of ``n_tokens`` tokens each.

    Every (context, arm) pair is visited round-robin, one request each per pass, after one warm-up pass: a burst of
    load from elsewhere on the machine then slows one request of every pair instead of every request of one pair, and
    the median per pair drops it. Two arms compared this way shared the machine's state request by request, which
    timing them one after the other (or one context at a time) does not give. ``fill="fast"`` fills each request's
    fresh cache with random K/V (a step's time depends on the bytes, not their values); ``fill="prefill"`` runs a
    real prefill of random tokens, and TTFT then includes it.

    The prediction divides bytes by the read bandwidth (a decode step reads; it hardly writes), measured once for all
    arms in the same run unless given, so that it shares the machine's state and thread count; every Sweep returned
    holds that one ``Bandwidth`` object. A ``bandwidth`` measured with another thread count than torch uses now is
    refused.
    """
    from tqdm.auto import tqdm

    if fill not in ("fast", "prefill"):
        raise ValueError(f"fill: {fill!r}; allowed: 'fast', 'prefill'")
    if not arms:
        raise ValueError("arms: empty; allowed: one or more kvlab.measure.sweep.Arm")
    contexts = sorted(set(contexts))
    if not contexts or contexts[0] < 1:
        raise ValueError(f"contexts: {contexts}; allowed: one or more positive token counts")
    if n_tokens < 2:
        raise ValueError(f"n_tokens: {n_tokens}; allowed: an integer >= 2 (TPOT needs two tokens)")
    if n_requests < 1:
        raise ValueError(f"n_requests: {n_requests}; allowed: an integer >= 1")
    device = next(iter(arms.values())).model.device
    if bandwidth is None:
        bandwidth = measure_bandwidth(device)
    elif device.type == "cpu" and bandwidth.threads not in (None, torch.get_num_threads()):
        raise ValueError(
            f"bandwidth: measured with {bandwidth.threads} threads; allowed: one measured with the "
            f"{torch.get_num_threads()} threads torch uses now (measure it again after set_num_threads)"
        )
    gen = torch.Generator().manual_seed(0)
    factories = {key: arm.make_cache or default_cache for key, arm in arms.items()}
    for key, arm in arms.items():
        _warm_up(arm.model, factories[key], arm.batch, warmup_steps)
    requests: dict[tuple[int, K], list[RequestTiming]] = {(c, key): [] for c in contexts for key in arms}
    step_bytes: dict[tuple[int, K], int] = {}
    kv_per_token: dict[K, float] = {}
    total = (n_requests + 1) * len(requests)
    cache = None
    with tqdm(total=total, desc="context sweep", unit="req", disable=not progress) as bar:
        for round_ in range(n_requests + 1):  # round 0 warms every pair's shapes and is not kept
            for context, key in requests:
                arm = arms[key]
                del cache  # the previous slab must go before the next one is allocated
                cache = factories[key](arm.model, arm.batch, context + n_tokens)
                prompt = _fill(arm.model, cache, context, fill, gen)
                timing = time_request(arm.model, cache, n_tokens, prompt)
                if round_:
                    requests[context, key].append(timing)
                weights = weight_bytes_read(arm.model.cfg, batch=arm.batch)
                step_bytes[context, key] = weights + cache.bytes_read_per_step(context)
                kv_per_token[key] = cache.bytes_per_token
                bar.update()
    return {
        key: Sweep(
            model=arm.model.cfg.name,
            device=str(arm.model.device),
            batch=arm.batch,
            fill=fill,
            bandwidth=bandwidth,
            kv_bytes_per_token=kv_per_token[key],
            weight_bytes_read=weight_bytes_read(arm.model.cfg, batch=arm.batch),
            points=[
                SweepPoint(
                    c,
                    arm.batch,
                    requests[c, key],
                    step_bytes[c, key],
                    predict_tpot_ms(step_bytes[c, key], bandwidth.read_gbps),
                )
                for c in contexts
            ],
            runtime=arm.model.runtime,
            weight_dtype=arm.model.weight_dtype,
        )
        for key, arm in arms.items()
    }


def sweep_context(
    model: Decoder,
    contexts: Sequence[int],
    n_tokens: int = 16,
    n_requests: int = 3,
    batch: int = 1,
    fill: str = "fast",
    warmup_steps: int = 3,
    bandwidth: Bandwidth | None = None,
    make_cache: CacheFactory | None = None,
    progress: bool = True,
) -> Sweep:
    """``interleaved_sweeps`` of one arm: the contexts visited round-robin, one request each per pass. To compare
    models, caches or batches, time them together with ``interleaved_sweeps``, never one ``sweep_context`` per
    context (that bunches each context's requests together in time, and loses the round-robin)."""
    arm = Arm(model, make_cache, batch)
    return interleaved_sweeps(
        {model.cfg.name: arm}, contexts, n_tokens, n_requests, fill, warmup_steps, bandwidth, progress
    )[model.cfg.name]


def _fill(model: Decoder, cache: KVCache, context: int, fill: str, gen: torch.Generator) -> torch.Tensor | None:
    """Fill ``context - 1`` tokens so that the first output step attends over ``context``; or return a prompt."""
    cache.reset()
    if fill == "prefill":
        return torch.randint(0, model.cfg.vocab_size, (cache.batch_size, context), generator=gen)
    if context > 1:
        cache.fast_fill(context - 1, generator=gen)
    return None


def _warm_up(model: Decoder, make_cache: CacheFactory, batch: int, steps: int) -> None:
    if steps > 0:
        time_request(model, make_cache(model, batch, steps), steps)
