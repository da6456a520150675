"""A request's life in the engine: ``Request`` in, a ``RequestHandle`` while it runs, a ``RequestResult`` out, and a
``RunReport`` of the whole run."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvlab.cache.storage.block_pool import int_tuple
from kvlab.metrics import RequestTiming, latency_summaries
from kvlab.model.sampling import SamplingParams, TokenLogprobs
from kvlab.spec.validation import require_int, require_number

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
        require_number("arrival_s", self.arrival_s, 0, note="seconds")
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


@dataclass(eq=False)
class RequestHandle:
    """A request inside the engine: what ``Engine.add`` returns and ``Engine.cancel`` takes.

    ``output`` and ``token_times`` (clock seconds) grow as its tokens are sampled. The scheduler owns the rest:
    while admitted, ``seq_id`` is its pool sequence and ``todo`` the tokens it has still to prefill.
    """

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
