"""A small continuous-batching engine on the paged cache: requests in, tokens (greedy or sampled) and vLLM's
latencies out.

    engine = Engine(model, n_blocks=256, block_size=16, max_batch=8)
    report = engine.run([Request(prompt, 32), Request(other, 16, arrival_s=0.5)])
    report.results[0].output_ids, report.results[0].ttft_ms, report.output_tokens_per_s, report.goodput(200, 50)

Three parts, as nano-vllm and vLLM split them: a ``Scheduler`` plans each step against the block pool alone
(``kvlab.engine.scheduler``), a ``Runner`` executes the plan on the model and a paged cache
(``kvlab.engine.runner``), and a clock stamps it (``kvlab.engine.clock``). Each admitted request is one pool
sequence. A step:

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

Preemption by recompute, newest first: before a call stores tokens, while the pool lacks the blocks it needs, the
newest running request is freed and put back at the front of the waiting queue, keeping its tokens. Readmitted,
it prefills prompt + generated tokens (its full blocks stay cached) and carries on, so its tokens are those
``model.generate`` gives it alone. The oldest running request is never the victim while another runs, and every
request fits the pool alone, so a run always completes and ``PoolExhaustedError`` never escapes it.

Online (``kvlab serve``): ``start()``, ``add(request, on_token)`` (it arrives at the clock's now; returns a
``RequestHandle``), ``step()`` while ``busy``, ``cancel(handle)`` (its blocks are freed at once). ``on_token`` gets
each token as it is sampled, with its logprobs when asked for. ``run`` is a loop over these same calls.

Clocks: ``"real"`` (wall time on the model's device), or a ``SimulatedClock``, which charges each call the byte
model's time, so a trace plays at the scale of any model and GPU; ``clock="simulated"`` with ``gpu=`` or
``bandwidth_gbps=`` builds one for the engine's model. With ``model=None`` there is no runner: the scheduler and a
``SimulatedClock`` alone play the trace, computing nothing, and every sampled token is ``PLACEHOLDER_TOKEN``
(requests then run to their ``max_new_tokens``).

Bad input: ``Request`` raises ``ValueError`` naming the field for what it can check alone. What depends on the
engine (ids outside the model's vocabulary, a request whose prompt + ``max_new_tokens - 1`` tokens exceed the
whole pool) gives that request a result with ``error`` set and no tokens; the others complete as if it were absent.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from functools import partial

from kvlab.cache.storage.block_pool import BlockPool
from kvlab.cache.storage.paged import PagedKVCache
from kvlab.engine.clock import Clock, RealClock, SimulatedClock
from kvlab.engine.request import OnToken, Request, RequestHandle, RequestResult, RunReport
from kvlab.engine.runner import Runner
from kvlab.engine.scheduler import Scheduler
from kvlab.machine.timing import Stopwatch
from kvlab.metrics import RequestTiming
from kvlab.model.decoder import Decoder
from kvlab.spec.presets import GPU
from kvlab.spec.validation import require_int

FollowUp = Callable[[int, list[int], float], Sequence[Request]]  # Engine.run's closed loop: (index, ids, s)
PLACEHOLDER_TOKEN = 0  # what a run with no model samples: a chat's replies are runs of it, their lengths known


# -- the engine --------------------------------------------------------------------------------------------------
class Engine:
    """Continuous batching of requests over one pool of KV blocks (module docstring: the step and the rules).

    ``model``: a ``Decoder``, or None to play requests with no model (the clock must then be a ``SimulatedClock``).
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
        model: Decoder | None,
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
        self.model = model
        self.scheduler = Scheduler(
            BlockPool(n_blocks, block_size),
            max_batch=max_batch,
            token_budget=token_budget,
            prefix_caching=prefix_caching,
            window=window,
            sinks=sinks,
        )
        self.kv_dtype, self.window, self.sinks = kv_dtype, window, sinks
        self.runner = None
        if model is not None:
            self.runner = Runner(
                model, self.scheduler.pool, kv_dtype=kv_dtype, window=window, sinks=sinks, prefix_caching=prefix_caching
            )
        self.clock = self._make_clock(clock, gpu, bandwidth_gbps)
        self._steps = 0
        self._finished: list[RequestHandle] = []  # the requests the last step finished (a run's follow-ups read them)

    def _make_clock(self, clock: str | Clock, gpu: str | GPU | None, bandwidth_gbps: float | None) -> Clock:
        if self.model is None and not isinstance(clock, SimulatedClock):
            raise ValueError(f"clock: {clock!r} with model=None; allowed: a SimulatedClock (nothing runs to be timed)")
        if clock == "simulated":
            if (gpu is None) == (bandwidth_gbps is None):
                raise ValueError("gpu, bandwidth_gbps: clock='simulated' takes exactly one of them")
            if gpu is not None:
                return SimulatedClock.for_gpu(self.model.cfg, gpu, self.kv_dtype, self.window, self.sinks)
            return SimulatedClock(self.model.cfg, bandwidth_gbps, None, self.kv_dtype, self.window, self.sinks)
        if gpu is not None or bandwidth_gbps is not None:
            raise ValueError(f"gpu, bandwidth_gbps: only for clock='simulated'; clock is {clock!r}")
        if clock == "real":
            return RealClock(partial(Stopwatch, self.model.device))
        if isinstance(clock, str) or not all(hasattr(clock, m) for m in ("start", "now", "charge", "wait_until")):
            raise ValueError(f"clock: {clock!r}; allowed: 'real', 'simulated', or a Clock (e.g. a SimulatedClock)")
        return clock

    @property
    def cache(self) -> PagedKVCache | None:
        """The runner's paged cache (None without a model)."""
        return None if self.runner is None else self.runner.cache

    @property
    def max_batch(self) -> int:
        """Running requests at most; set it between runs to change the batch the scheduler admits."""
        return self.scheduler.max_batch

    @max_batch.setter
    def max_batch(self, value: int) -> None:
        require_int("max_batch", value)
        self.scheduler.max_batch = value

    @property
    def token_budget(self) -> int:
        return self.scheduler.token_budget

    @property
    def prefix_caching(self) -> bool:
        return self.scheduler.prefix_caching

    @property
    def n_blocks(self) -> int:
        return self.scheduler.pool.n_blocks

    @property
    def free_blocks(self) -> int:
        """Blocks no sequence holds (cached prefix blocks among them: they are reused when needed)."""
        return self.scheduler.pool.n_free

    @property
    def block_size(self) -> int:
        return self.scheduler.block_size

    # -- online: start, add, step, cancel (a server calls these from one thread) -------------------------------------
    def start(self) -> None:
        """Start the clock and the counters, with nothing queued (the pool's cached prefix blocks stay)."""
        self.scheduler.reset()
        self._steps = 0
        self.clock.start()

    def add(self, request: Request, on_token: OnToken | None = None) -> RequestHandle:
        """Queue ``request``, arriving now; ``on_token(id, logprobs)`` gets each token as it is sampled (from inside
        ``step``; ``logprobs`` is None unless the request's sampling asks for them).

        Returns the handle ``cancel`` takes. Raises ``ValueError`` naming the field if the engine cannot serve it.
        """
        if not isinstance(request, Request):
            raise ValueError(f"request: {request!r}; allowed: a kvlab.engine.request.Request")
        x = self._handle(-1, request, self.clock.now(), on_token)
        error = self._reject(x)
        if error:
            raise ValueError(error)
        self.scheduler.waiting.append(x)
        return x

    @property
    def busy(self) -> bool:
        """Requests are waiting or running: ``step`` has work."""
        return bool(self.scheduler.waiting or self.scheduler.running)

    def step(self) -> None:
        """One step (module docstring): the scheduler's plan, run by the runner, charged and stamped by the clock."""
        plan = self.scheduler.schedule()
        if self.runner is None:
            sampled = [(x, PLACEHOLDER_TOKEN, None) for x in plan.samples]
        else:
            sampled = self.runner.execute(plan)
        self.clock.charge(plan.calls)
        now = self.clock.now()
        self._finished = []
        for x, token, logprobs in sampled:
            x.token_times.append(now)
            if self.scheduler.record(x, token):
                self._finished.append(x)
            if x.on_token is not None:  # after the bookkeeping, so a callback that cancels finds a consistent engine
                x.on_token(token, logprobs)
        self._steps += 1

    def cancel(self, handle: RequestHandle) -> None:
        """Drop a waiting or running request; a running one's blocks are freed now. A finished one is left as is."""
        self.scheduler.cancel(handle)

    # -- a run ----------------------------------------------------------------------------------------------------
    def run(self, requests: Sequence[Request], follow_up: FollowUp | None = None) -> RunReport:
        """Serve ``requests`` (arriving at their ``arrival_s``) to completion; one result each, in request order.

        ``follow_up(index, output_ids, finish_s)`` makes a closed loop, as a chat is: it is called when request
        ``index`` has its last token (at clock time ``finish_s``) and returns the requests that this one's answer
        sets off, such as the conversation's next turn, whose prompt holds the reply. Each must arrive at or after
        ``finish_s``; they are numbered after every request before them, and their results follow in that order.
        A request the engine cannot serve (ids outside the vocabulary, more tokens than the whole pool) raises
        nothing: its result has ``error`` set and no tokens, and the others run as if it were absent.
        """
        if any(not isinstance(r, Request) for r in requests):
            raise ValueError(f"requests: {list(requests)!r}; allowed: a sequence of kvlab.engine.request.Request")
        live = [self._handle(i, r, r.arrival_s) for i, r in enumerate(requests)]
        errors = {x.index: self._reject(x) for x in live}
        # Latest first, so the next to arrive pops off the end (ties: the lower index first, as they were given).
        arrivals = sorted((x for x in live if errors[x.index] is None), key=lambda x: x.arrival)[::-1]
        self.start()
        try:
            while arrivals or self.busy:
                now = self.clock.now()
                while arrivals and arrivals[-1].arrival <= now:
                    self.scheduler.waiting.append(arrivals.pop())
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
            self.scheduler.release()
        results = [
            RequestResult([], None, error=errors[x.index])
            if errors[x.index]
            else RequestResult(x.output, RequestTiming(tuple(t - x.arrival for t in x.token_times)), x.preemptions)
            for x in live
        ]
        return RunReport(
            results,
            self.clock.now(),
            self.scheduler.prefix_hit_tokens,
            self.scheduler.preemptions,
            self._steps,
            self.scheduler.max_running,
            self.scheduler.peak_blocks,
        )

    def _follow(self, request: Request, index: int, now: float, errors: dict[int, str | None]) -> RequestHandle:
        """A request a follow-up returned, numbered ``index``, with its error (if any) recorded in ``errors``."""
        if not isinstance(request, Request):
            raise ValueError(f"follow_up: returned {request!r}; allowed: a sequence of kvlab.engine.request.Request")
        if request.arrival_s < now:
            raise ValueError(
                f"follow_up: a request arriving at {request.arrival_s} s, before the answer it follows "
                f"({now} s); allowed: arrival_s >= the finish time it was given"
            )
        x = self._handle(index, request, request.arrival_s)
        errors[index] = self._reject(x)
        return x

    def _handle(self, index: int, request: Request, arrival: float, on_token: OnToken | None = None) -> RequestHandle:
        gen = None if self.runner is None else self.runner.generator(request)
        return RequestHandle(index, request, arrival, on_token, generator=gen)

    def _reject(self, x: RequestHandle) -> str | None:
        """Why the engine cannot serve this request (None if it can)."""
        return (self.runner and self.runner.reject(x.request)) or self.scheduler.reject(x)
