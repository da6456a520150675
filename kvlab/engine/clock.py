"""The engine's clocks: ``RealClock`` (wall time) and ``SimulatedClock`` (the byte model's time for each call a
step plan makes). Torch-free: the simulated path plans and charges steps with no model."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from kvlab.engine.scheduler import ModelCall
from kvlab.roofline import (
    active_params,
    decode_attention_flops,
    kv_bytes_per_step,
    kv_bytes_per_token,
    weight_bytes_read,
)
from kvlab.spec.config import ModelConfig
from kvlab.spec.presets import GPU, get_gpu
from kvlab.spec.validation import require_number


class Clock(Protocol):
    def start(self) -> None: ...
    def now(self) -> float: ...  # seconds since start
    def charge(self, calls: Sequence[ModelCall]) -> None: ...  # a step's work just ran
    def wait_until(self, t: float) -> None: ...


class Watch(Protocol):
    def elapsed(self) -> float: ...  # seconds since it started, once the device has finished queued work


class RealClock:
    """Wall time on the model's device: ``new_watch()`` starts a ``kvlab.machine.timing.Stopwatch`` on it (the
    engine passes one), which waits for queued work before it reads; built by the caller, so this module loads no
    torch."""

    def __init__(self, new_watch: Callable[[], Watch]) -> None:
        self._new_watch = new_watch
        self._watch: Watch | None = None

    def start(self) -> None:
        self._watch = self._new_watch()

    def now(self) -> float:
        if self._watch is None:
            raise RuntimeError("the clock has not started: call Engine.start() before add or step (run starts it)")
        return self._watch.elapsed()

    def charge(self, calls: Sequence[ModelCall]) -> None:
        pass  # the calls took their own time

    def wait_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self.now()))


class SimulatedClock:
    """Time as the byte model predicts it for ``cfg`` at ``bandwidth_gbps`` (and ``peak_flops_per_s``, if given).

    A call whose rows hold ``n`` new tokens over ``c`` cached ones (each row) takes ``max(FLOPs / peak, bytes /
    bandwidth)`` (bytes / bandwidth without a peak), where

    - bytes = ``weight_bytes_read(cfg, batch=sum n)``, the weights once per call; plus per row the K/V it attends
      over, ``kv_bytes_per_step(cfg, c + n, kv_dtype=, window=, sinks=)`` (a local layer of ``cfg``, or a
      ``window`` + ``sinks`` policy, reads only what it keeps), and the ``n`` tokens' K/V it writes;
    - FLOPs = ``2 x active_params(cfg) x sum n`` + attention's ``4 x layers x heads x head_dim`` per (query, key)
      pair, ``sum(n c + n (n + 1) / 2)`` pairs (causal within the chunk), every pair even where a window skips it
      (decode is bound by bytes; the FLOPs matter for long prefill chunks).

    A step's calls add up: this engine runs its decode batch and each prefill chunk as calls of their own (a fused
    engine would read the weights once per step). Blocks are charged by the token, not whole.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        bandwidth_gbps: float,
        peak_flops_per_s: float | None = None,
        kv_dtype: str | None = None,
        window: int | None = None,
        sinks: int = 0,
    ) -> None:
        require_number("bandwidth_gbps", bandwidth_gbps, 0, low_open=True, note="GB/s")
        require_number("peak_flops_per_s", peak_flops_per_s, 0, low_open=True, note="FLOP/s", or_none=True)
        if not isinstance(cfg, ModelConfig):
            raise ValueError(f"cfg: a {type(cfg).__name__}; allowed: a ModelConfig (for a Decoder, its .cfg)")
        self.cfg, self.bandwidth_gbps, self.peak_flops_per_s = cfg, bandwidth_gbps, peak_flops_per_s
        self.kv_dtype, self.window, self.sinks = kv_dtype, window, sinks
        self.kv_bytes_per_token = kv_bytes_per_token(cfg, kv_dtype)
        kv_bytes_per_step(cfg, 0, 1, kv_dtype, window, sinks)  # refuses a bad window or sinks now, not mid-run
        self._t = 0.0

    @classmethod
    def for_gpu(
        cls, cfg: ModelConfig, gpu: str | GPU, kv_dtype: str | None = None, window: int | None = None, sinks: int = 0
    ) -> SimulatedClock:
        """A GPU preset's datasheet bandwidth and bf16 FLOP/s (``kvlab gpus`` lists them)."""
        spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
        peak = None if spec.bf16_tflops is None else spec.bf16_tflops * 1e12
        return cls(cfg, spec.bandwidth_gbps, peak, kv_dtype, window, sinks)

    def call_bytes(self, call: ModelCall) -> int:
        new = sum(n for n, _ in call.rows)
        read = sum(
            kv_bytes_per_step(self.cfg, cached + n, 1, self.kv_dtype, self.window, self.sinks)
            for n, cached in call.rows
        )
        return weight_bytes_read(self.cfg, batch=new) + read + self.kv_bytes_per_token * new

    def call_flops(self, call: ModelCall) -> int:
        pairs = sum(n * cached + n * (n + 1) // 2 for n, cached in call.rows)
        attention = decode_attention_flops(self.cfg.n_layers, self.cfg.n_heads * self.cfg.head_dim, pairs)
        return 2 * active_params(self.cfg) * sum(n for n, _ in call.rows) + attention

    def call_seconds(self, call: ModelCall) -> float:
        memory = self.call_bytes(call) / (self.bandwidth_gbps * 1e9)
        return memory if self.peak_flops_per_s is None else max(memory, self.call_flops(call) / self.peak_flops_per_s)

    def start(self) -> None:
        self._t = 0.0

    def now(self) -> float:
        return self._t

    def charge(self, calls: Sequence[ModelCall]) -> None:
        self._t += sum(self.call_seconds(c) for c in calls)

    def wait_until(self, t: float) -> None:
        self._t = max(self._t, t)
