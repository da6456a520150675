"""A small continuous-batching engine on the paged cache: requests in, tokens (greedy or sampled) and vLLM's
latencies out.

    engine = Engine(model, n_blocks=256, block_size=16, max_batch=8)
    report = engine.run([Request(prompt, 32), Request(other, 16, arrival_s=0.5)])
    report.results[0].output_ids, report.results[0].ttft_ms, report.output_tokens_per_s, report.goodput(200, 50)

One pool of blocks (``PagedKVCache``) serves the engine's whole life; each admitted request is one pool sequence.
A step, as vLLM's scheduler runs it (nano-vllm's reads the same way):

1. Requests whose ``arrival_s`` has come join the waiting queue (preempted ones wait at its front). The oldest
   waiting ones are admitted while the batch is under ``max_batch`` and the pool's free blocks, less those the
   admitted prefills will still take, hold the rest of the prompt (its prefix hits need none) and one decode.
2. One decode call over every running request whose prompt is done: each stores its last token and samples the
   next (greedy, or as its ``SamplingParams`` say, from its own seeded generator), at its own position (a ragged
   batch). A request ends at ``max_new_tokens`` or at a token of its ``stop_token_ids``.
3. Prefill chunks, oldest request first, with what is left of ``token_budget`` (tokens per step, decodes
   counted first): a request whose prompt completes samples its first token from the chunk's last logits.

Every token sampled in a step is stamped with the clock at the step's end, so TTFT, TPOT, ITL and E2EL follow
vLLM's definitions (``kvlab.metrics.RequestTiming``), measured from the request's arrival (queueing counts).

Preemption by recompute, newest first: before a call stores tokens, the engine checks the pool holds the blocks it
needs (a decode row whose length is a multiple of ``block_size`` starts a block); while it does not, the newest
running request is freed and put back at the front of the waiting queue, keeping the tokens it generated. Once
readmitted it prefills prompt + generated tokens (prefix hits make that cheap: its full blocks stay cached) and
carries on from the last logits, so its tokens are those ``model.generate`` gives it alone. The oldest running
request is never the victim while another runs, and every request fits the pool alone (step 1 checks), so a run
always completes and ``PoolExhaustedError`` never escapes it.

Online (``kvlab serve``): ``start()``, then ``add(request, on_token)`` whenever a request comes in (it arrives at
the clock's now), ``step()`` while ``busy``, and ``cancel(handle)`` for a client that went away (its blocks are
freed at once). ``on_token`` receives each token as it is sampled (with its logprobs, when
the request's ``SamplingParams`` ask for them). ``run`` is a loop over these same calls.

Clocks: ``"real"`` reads ``kvlab.machine.timing.Stopwatch`` (arrivals then wait in real time). ``SimulatedClock`` charges
each model call the byte model's time instead, so a trace plays at the scale of any model and GPU (its formula is
in its docstring); ``clock="simulated"`` with ``gpu=`` or ``bandwidth_gbps=`` builds one for the engine's model.

Bad input: ``Request`` raises ``ValueError`` naming the field for what it can check alone (an empty prompt,
negative or non-integer ids, ``max_new_tokens < 1``, a negative arrival). What depends on the engine (ids outside
the model's vocabulary, a request whose prompt + ``max_new_tokens - 1`` tokens exceed the whole pool) gives that
request a result with ``error`` set and no tokens; the other requests complete as if it were absent.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvlab.cache.storage.block_pool import int_tuple
from kvlab.cache.storage.paged import PagedKVCache
from kvlab.machine.timing import Stopwatch
from kvlab.metrics import RequestTiming, latency_summaries
from kvlab.model.decoder import Decoder
from kvlab.model.sampling import SamplingParams, TokenLogprobs, choose
from kvlab.roofline import (
    active_params,
    decode_attention_flops,
    kv_bytes_per_step,
    kv_bytes_per_token,
    weight_bytes_read,
)
from kvlab.spec.config import ModelConfig
from kvlab.spec.presets import GPU, get_gpu
from kvlab.spec.validation import require_int

FollowUp = Callable[[int, list[int], float], Sequence["Request"]]  # Engine.run's closed loop: (index, ids, s)
OnToken = Callable[[int, TokenLogprobs | None], None]  # a token as it is sampled, and its logprobs if asked for


# -- requests and results ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    """A prompt (token ids), how many tokens to generate at most, when it arrives (seconds after the start), and how
    its tokens are picked: greedily without ``sampling``, else by ``SamplingParams`` (which may also stop it early)."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    arrival_s: float = 0.0
    sampling: SamplingParams | None = None

    def __post_init__(self) -> None:
        ids = self.prompt_ids.tolist() if isinstance(self.prompt_ids, torch.Tensor) else self.prompt_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or not ids:
            raise ValueError(f"prompt_ids: {self.prompt_ids!r}; allowed: a non-empty sequence of token ids")
        # set(map(type, ...)) runs in C: a 30k-token chat prompt is checked in a fraction of a millisecond
        if not set(map(type, ids)) <= {int} and any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise ValueError(f"prompt_ids: {list(ids)}; allowed: integer token ids >= 0")
        if min(ids) < 0:
            raise ValueError(f"prompt_ids: {list(ids)}; allowed: integer token ids >= 0")
        require_int("max_new_tokens", self.max_new_tokens)
        if isinstance(self.arrival_s, bool) or not isinstance(self.arrival_s, (int, float)):
            raise ValueError(f"arrival_s: {self.arrival_s!r}; allowed: a finite number of seconds >= 0")
        if not 0 <= self.arrival_s < math.inf:
            raise ValueError(f"arrival_s: {self.arrival_s!r}; allowed: a finite number of seconds >= 0")
        if self.sampling is not None and not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling: {self.sampling!r}; allowed: None or a kvlab.model.sampling.SamplingParams")
        object.__setattr__(self, "prompt_ids", int_tuple(ids))


@dataclass(frozen=True)
class RequestResult:
    """One request's tokens and latencies (ms, vLLM's definitions), or ``error`` and no tokens.

    ``tpot_ms`` is ``None`` for a single output token (vLLM leaves such requests out of TPOT).
    """

    output_ids: list[int]
    timing: RequestTiming | None
    preemptions: int = 0
    error: str | None = None

    @property
    def ttft_ms(self) -> float | None:
        return None if self.timing is None else self.timing.ttft_ms

    @property
    def tpot_ms(self) -> float | None:
        return None if self.timing is None or len(self.output_ids) < 2 else self.timing.tpot_ms

    @property
    def itl_ms(self) -> list[float]:
        return [] if self.timing is None else self.timing.itl_ms

    @property
    def e2el_ms(self) -> float | None:
        return None if self.timing is None else self.timing.e2el_ms


@dataclass(frozen=True)
class RunReport:
    """What one ``Engine.run`` did: ``results`` in request order, and the run's totals.

    ``duration_s`` runs from the clock's start (time 0 of the arrivals) to the last token. ``prefix_hit_tokens``
    counts prompt tokens whose K/V an admission found in the pool, readmissions after preemption included.
    ``max_running`` is the most requests running at once (admitted, not finished); ``peak_blocks`` the most blocks
    sequences held at once, counted after each model call stored its tokens (a cached block no sequence holds is
    free, so it does not count).
    """

    results: list[RequestResult]
    duration_s: float
    prefix_hit_tokens: int
    preemptions: int
    steps: int
    max_running: int
    peak_blocks: int

    @property
    def completed(self) -> list[RequestResult]:
        return [r for r in self.results if r.error is None]

    @property
    def output_tokens(self) -> int:
        return sum(len(r.output_ids) for r in self.results)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else math.inf

    @property
    def requests_per_s(self) -> float:
        return len(self.completed) / self.duration_s if self.duration_s > 0 else math.inf

    def goodput(self, ttft_ms: float, tpot_ms: float) -> float:
        """Completed requests per second that met both SLOs: TTFT <= ``ttft_ms`` and TPOT <= ``tpot_ms`` (a request
        of one token has no TPOT and is judged on TTFT alone)."""
        good = [r for r in self.completed if r.ttft_ms <= ttft_ms and (r.tpot_ms is None or r.tpot_ms <= tpot_ms)]
        return len(good) / self.duration_s if self.duration_s > 0 else math.inf

    def metrics(self) -> dict[str, float]:
        """Throughput and vLLM-named summaries (``mean_ttft_ms``, ``p99_tpot_ms``, ...) over completed requests."""
        out = {"output_tokens_per_s": self.output_tokens_per_s, "requests_per_s": self.requests_per_s}
        return out | latency_summaries(self.completed)


# -- clocks ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelCall:
    """One forward the engine ran: per row, ``(new tokens, tokens already cached)``."""

    rows: tuple[tuple[int, int], ...]


class Clock(Protocol):
    def start(self) -> None: ...
    def now(self) -> float: ...  # seconds since start
    def charge(self, calls: Sequence[ModelCall]) -> None: ...  # a step's work just ran
    def wait_until(self, t: float) -> None: ...


class RealClock:
    """Wall time on the model's device (``Stopwatch``: it waits for queued work before reading)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._watch: Stopwatch | None = None

    def start(self) -> None:
        self._watch = Stopwatch(self.device)

    def now(self) -> float:
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
        if not isinstance(bandwidth_gbps, (int, float)) or not bandwidth_gbps > 0:
            raise ValueError(f"bandwidth_gbps: {bandwidth_gbps!r}; allowed: a number of GB/s > 0")
        if peak_flops_per_s is not None and not peak_flops_per_s > 0:
            raise ValueError(f"peak_flops_per_s: {peak_flops_per_s!r}; allowed: None or a number of FLOP/s > 0")
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


# -- the engine --------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Live:
    """A request inside a run: its tokens so far and, while admitted, its pool sequence and unprefilled tokens."""

    index: int
    request: Request
    arrival: float  # clock seconds: the request's arrival_s in a run, the clock at ``add`` online
    on_token: OnToken | None = None
    output: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    seq_id: int | None = None  # None: waiting (not yet admitted, preempted) or finished
    todo: Sequence[int] = ()  # tokens still to prefill
    preemptions: int = 0
    admitted: bool = False  # it has left the waiting queue once (a preempted request stays admitted)
    stopped: bool = False  # it sampled one of its stop tokens
    generator: torch.Generator | None = None  # its own random stream, when it samples

    @property
    def tokens(self) -> tuple[int, ...]:
        return (*self.request.prompt_ids, *self.output)

    @property
    def final_length(self) -> int:
        """Tokens the pool ever holds for it: the last output token is sampled, never stored."""
        return len(self.request.prompt_ids) + self.request.max_new_tokens - 1

    @property
    def done(self) -> bool:
        return self.stopped or len(self.output) == self.request.max_new_tokens


class Engine:
    """Continuous batching of requests over one ``PagedKVCache`` (module docstring: the step and the rules).

    ``max_batch``: running requests at most. ``token_budget``: tokens one step computes (decodes, then prefill
    chunks). ``prefix_caching``: reuse the K/V of cached prompt blocks. ``clock``: ``"real"``, ``"simulated"``
    (with ``gpu=`` a preset name, or ``bandwidth_gbps=``), or any ``Clock`` such as a ``SimulatedClock`` of another
    model's shape. ``kv_dtype``: what the blocks store (``kvlab.spec.dtypes.KV_DTYPES``; default the model's dtype).
    ``window`` + ``sinks``: each request keeps its first ``sinks`` tokens and its ``window`` most recent ones, and
    the blocks in between go back to the pool (``PagedKVCache``'s policy). A simulated clock the engine builds
    charges what these store and read.
    """

    def __init__(
        self,
        model: Decoder,
        *,
        n_blocks: int,
        block_size: int = 16,
        kv_dtype: str | None = None,
        window: int | None = None,
        sinks: int = 0,
        max_batch: int = 8,
        token_budget: int = 512,
        prefix_caching: bool = True,
        clock: str | Clock = "real",
        gpu: str | GPU | None = None,
        bandwidth_gbps: float | None = None,
    ) -> None:
        require_int("max_batch", max_batch)
        require_int("token_budget", token_budget)
        if not isinstance(prefix_caching, bool):
            raise ValueError(f"prefix_caching: {prefix_caching!r}; allowed: True or False")
        self.model, self.max_batch, self.token_budget, self.prefix_caching = (
            model,
            max_batch,
            token_budget,
            prefix_caching,
        )
        self.kv_dtype, self.window, self.sinks = kv_dtype, window, sinks
        self.cache = PagedKVCache.for_model(
            model,
            capacity=None,
            n_blocks=n_blocks,
            block_size=block_size,
            codec=kv_dtype,
            window=window,
            sinks=sinks,
        )
        self.cache.free(self.cache.seq_ids[0])  # the pool starts with no sequences; admissions add them
        self.clock = self._make_clock(clock, gpu, bandwidth_gbps)
        self._waiting: deque[_Live] = deque()
        self._running: list[_Live] = []  # admission order: the last is the newest, preempted first
        self._hits = self._preemptions = self._max_running = self._peak_blocks = self._steps = 0
        self._finished: list[_Live] = []  # the requests the last step finished (a run's follow-ups read them)

    def _make_clock(self, clock: str | Clock, gpu: str | GPU | None, bandwidth_gbps: float | None) -> Clock:
        if clock == "simulated":
            if (gpu is None) == (bandwidth_gbps is None):
                raise ValueError("gpu, bandwidth_gbps: clock='simulated' takes exactly one of them")
            if gpu is not None:
                return SimulatedClock.for_gpu(self.model.cfg, gpu, self.kv_dtype, self.window, self.sinks)
            return SimulatedClock(self.model.cfg, bandwidth_gbps, None, self.kv_dtype, self.window, self.sinks)
        if gpu is not None or bandwidth_gbps is not None:
            raise ValueError(f"gpu, bandwidth_gbps: only for clock='simulated'; clock is {clock!r}")
        if clock == "real":
            return RealClock(self.model.device)
        if isinstance(clock, str) or not all(hasattr(clock, m) for m in ("start", "now", "charge", "wait_until")):
            raise ValueError(f"clock: {clock!r}; allowed: 'real', 'simulated', or a Clock (e.g. a SimulatedClock)")
        return clock

    @property
    def n_blocks(self) -> int:
        return self.cache.pool.n_blocks

    @property
    def free_blocks(self) -> int:
        """Blocks no sequence holds (cached prefix blocks among them: they are reused when needed)."""
        return self.cache.pool.n_free

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    # -- online: start, add, step, cancel (a server calls these from one thread) -------------------------------------
    def start(self) -> None:
        """Start the clock and the counters, with nothing queued (the pool's cached prefix blocks stay)."""
        self._release()
        self._waiting.clear()
        self._hits = self._preemptions = self._max_running = self._peak_blocks = self._steps = 0
        self.clock.start()

    def add(self, request: Request, on_token: OnToken | None = None) -> _Live:
        """Queue ``request``, arriving now; ``on_token(id, logprobs)`` gets each token as it is sampled (from inside
        ``step``; ``logprobs`` is None unless the request's sampling asks for them).

        Returns the handle ``cancel`` takes. Raises ``ValueError`` naming the field if the engine cannot serve it.
        """
        if not isinstance(request, Request):
            raise ValueError(f"request: {request!r}; allowed: a kvlab.engine.engine.Request")
        x = self._live(-1, request, self.clock.now(), on_token)
        error = self._reject(x)
        if error:
            raise ValueError(error)
        self._waiting.append(x)
        return x

    @property
    def busy(self) -> bool:
        """Requests are waiting or running: ``step`` has work."""
        return bool(self._waiting or self._running)

    def step(self) -> None:
        """One scheduler step: admit what fits, one decode call, prefill chunks (module docstring)."""
        self._finished = []
        self._admit()
        self._max_running = max(self._max_running, len(self._running))
        self._step()
        self._steps += 1

    def cancel(self, handle: _Live) -> None:
        """Drop a waiting or running request; a running one's blocks are freed now. A finished one is left as is."""
        if handle in self._waiting:
            self._waiting.remove(handle)
        elif handle in self._running:
            self.cache.free(handle.seq_id)
            self._running.remove(handle)
            handle.seq_id, handle.todo = None, ()

    def _release(self) -> None:
        """Free every running request's blocks (after an error from the model, too: none may stay held)."""
        for x in self._running:
            self.cache.free(x.seq_id)
        self._running.clear()

    # -- a run ----------------------------------------------------------------------------------------------------
    def run(self, requests: Sequence[Request], follow_up: FollowUp | None = None) -> RunReport:
        """Serve ``requests`` (arriving at their ``arrival_s``) to completion; one result each, in request order.

        ``follow_up(index, output_ids, finish_s)`` makes a closed loop, as a chat is: it is called when request
        ``index`` has its last token (at clock time ``finish_s``) and returns the requests that this one's answer
        sets off, such as the conversation's next turn, whose prompt holds the reply. Each must arrive at or after
        ``finish_s``; they are numbered after every request before them, and their results follow in that order.
        """
        if any(not isinstance(r, Request) for r in requests):
            raise ValueError(f"requests: {list(requests)!r}; allowed: a sequence of kvlab.engine.engine.Request")
        live = [self._live(i, r, r.arrival_s) for i, r in enumerate(requests)]
        errors = {x.index: self._reject(x) for x in live}
        # Latest first, so the next to arrive pops off the end (ties: the lower index first, as they were given).
        arrivals = sorted((x for x in live if errors[x.index] is None), key=lambda x: x.arrival)[::-1]
        self.start()
        try:
            while arrivals or self.busy:
                now = self.clock.now()
                while arrivals and arrivals[-1].arrival <= now:
                    self._waiting.append(arrivals.pop())
                if not self.busy:
                    self.clock.wait_until(arrivals[-1].arrival)
                    continue
                self.step()
                if follow_up is not None:
                    for x in self._finished:
                        finish = x.token_times[-1]  # its last token's stamp: a real clock has moved on since
                        for r in follow_up(x.index, list(x.output), finish):
                            live.append(self._follow(r, len(live), finish, errors))
                            if errors[live[-1].index] is None:
                                bisect.insort_left(arrivals, live[-1], key=lambda y: -y.arrival)
        finally:
            self._release()
        results = [
            RequestResult([], None, error=errors[x.index])
            if errors[x.index]
            else RequestResult(x.output, RequestTiming(tuple(t - x.arrival for t in x.token_times)), x.preemptions)
            for x in live
        ]
        return RunReport(
            results, self.clock.now(), self._hits, self._preemptions, self._steps, self._max_running, self._peak_blocks
        )

    def _follow(self, request: Request, index: int, now: float, errors: dict[int, str | None]) -> _Live:
        """A request a follow-up returned, numbered ``index``, with its error (if any) recorded in ``errors``."""
        if not isinstance(request, Request):
            raise ValueError(f"follow_up: returned {request!r}; allowed: a sequence of kvlab.engine.engine.Request")
        if request.arrival_s < now:
            raise ValueError(
                f"follow_up: a request arriving at {request.arrival_s} s, before the answer it follows "
                f"({now} s); allowed: arrival_s >= the finish time it was given"
            )
        x = self._live(index, request, request.arrival_s)
        errors[index] = self._reject(x)
        return x

    def _live(self, index: int, request: Request, arrival: float, on_token: OnToken | None = None) -> _Live:
        gen = None if request.sampling is None else request.sampling.generator(self.model.device)
        return _Live(index, request, arrival, on_token, generator=gen)

    def _reject(self, x: _Live) -> str | None:
        """Why the engine cannot serve this request (None if it can)."""
        ids, vocab = x.request.prompt_ids, self.model.cfg.vocab_size
        if max(ids) >= vocab:
            return f"prompt_ids: ids up to {max(ids)}; allowed: 0 <= id < vocab_size={vocab}"
        room = self.n_blocks * self.block_size
        if x.final_length > room:
            return (
                f"prompt_ids, max_new_tokens: {len(ids)} prompt tokens + max_new_tokens={x.request.max_new_tokens} "
                f"need {x.final_length} cached tokens; allowed: at most the whole pool, n_blocks x block_size = "
                f"{self.n_blocks} x {self.block_size} = {room}"
            )
        return None

    # -- scheduling -----------------------------------------------------------------------------------------------
    def _blocks_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.block_size)

    def _still_to_take(self, x: _Live) -> int:
        """Blocks an admitted request's prefill and first decode will still take from the pool."""
        stored = self.cache.pool.length(x.seq_id)
        target = min(stored + len(x.todo) + 1, x.final_length)
        return self._blocks_for(target) - len(self.cache.pool.block_table(x.seq_id))

    def _admit(self) -> None:
        pool = self.cache.pool
        while self._waiting and len(self._running) < self.max_batch:
            x = self._waiting[0]
            tokens = x.tokens
            hits = pool.cached_prefix(tokens)[: (len(tokens) - 1) // self.block_size] if self.prefix_caching else []
            # Hit blocks that no sequence holds are in the free count, and admitting takes them out of it.
            idle_hits = sum(pool.ref_count(b) == 0 for b in hits)
            need = self._blocks_for(min(len(tokens) + 1, x.final_length)) - len(hits) + idle_hits
            promised = sum(self._still_to_take(r) for r in self._running if r.todo)
            if pool.n_free - promised < need:
                return
            self._waiting.popleft()
            x.seq_id, n_cached = self.cache.new_sequence(tokens if self.prefix_caching else ())
            x.todo = tokens[n_cached:]
            x.admitted = True
            self._hits += n_cached
            self._running.append(x)

    def _step(self) -> None:
        calls, sampled = [], []
        decoding = [x for x in self._running if not x.todo]
        if decoding:
            calls += self._decode(decoding, sampled)
        budget = self.token_budget - sum(n for call in calls for n, _ in call.rows)
        for x in [x for x in self._running if x.todo]:
            if budget <= 0:
                break
            if x.seq_id is not None:  # not preempted by an earlier chunk of this step
                n = min(budget, len(x.todo))
                calls += self._prefill(x, n, sampled)
                budget -= n
        self.clock.charge(calls)
        now = self.clock.now()
        for x in sampled:
            x.token_times.append(now)

    def _make_room(self, needed: Callable[[], int]) -> None:
        """Preempt the newest running requests until the pool holds ``needed()`` free blocks."""
        while self.cache.pool.n_free < needed():
            victim = self._running.pop()
            self.cache.free(victim.seq_id)
            victim.seq_id, victim.todo = None, ()
            victim.preemptions += 1
            self._preemptions += 1
            self._waiting.appendleft(victim)

    def _decode(self, rows: list[_Live], sampled: list[_Live]) -> list[ModelCall]:
        """Store each row's last token and sample its next one, in one call."""
        pool = self.cache.pool
        self._make_room(lambda: sum(pool.length(x.seq_id) % self.block_size == 0 for x in rows if x.seq_id is not None))
        rows = [x for x in rows if x.seq_id is not None]
        if not rows:
            return []
        cached = [pool.length(x.seq_id) for x in rows]
        last = [x.output[-1] for x in rows]
        self.cache.use([x.seq_id for x in rows])
        if self.prefix_caching:  # so the generated tokens' blocks are cached too (a preempted request reuses them)
            self.cache.feed_tokens([[t] for t in last])
        logits = self.model.decode_step(torch.tensor(last, device=self.model.device), self.cache)
        self._note_blocks()
        for x, row, token in zip(rows, logits, logits.argmax(-1).tolist(), strict=True):
            self._sample(x, row, token, sampled)
        return [ModelCall(tuple((1, c) for c in cached))]

    def _prefill(self, x: _Live, n: int, sampled: list[_Live]) -> list[ModelCall]:
        """Prefill the next ``n`` of ``x``'s tokens; if that ends them, sample its next token."""
        pool = self.cache.pool
        start = pool.length(x.seq_id)
        self._make_room(
            lambda: 0 if x.seq_id is None else self._blocks_for(start + n) - len(pool.block_table(x.seq_id))
        )
        if x.seq_id is None:  # it was the newest: preempted to make room for itself
            return []
        chunk, x.todo = x.todo[:n], x.todo[n:]
        self.cache.use([x.seq_id])
        logits = self.model.prefill(torch.tensor([chunk], device=self.model.device), self.cache)
        self._note_blocks()
        if not x.todo:
            self._sample(x, logits[0, -1], int(logits[0, -1].argmax()), sampled)
        return [ModelCall(((n, start),))]

    def _note_blocks(self) -> None:
        self._peak_blocks = max(self._peak_blocks, self.n_blocks - self.cache.pool.n_free)

    def _sample(self, x: _Live, logits: torch.Tensor, argmax: int, sampled: list[_Live]) -> None:
        """Pick ``x``'s next token from its ``logits`` ``[V]``: ``argmax`` (greedy), or as its sampling says."""
        token, logprobs = argmax, None
        if x.request.sampling is not None:
            token, logprobs = choose(logits, x.request.sampling, x.generator, argmax)
            x.stopped = token in x.request.sampling.stop_token_ids
        x.output.append(token)
        sampled.append(x)
        if x.done:
            self.cache.free(x.seq_id)
            self._running.remove(x)
            x.seq_id = None
            self._finished.append(x)
        if x.on_token is not None:  # after the bookkeeping, so a callback that cancels finds a consistent engine
            x.on_token(token, logprobs)
