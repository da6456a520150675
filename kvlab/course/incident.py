"""The capstone incident: a chat service whose TPOT climbs as its conversations grow, replayed through the engine.

A ``ChatTrace`` is the service's traffic: sessions that start over time, each a system prompt shared by every
session, then turns (a user message; a reply of a known length), each sent a think time after the previous reply
ended. ``replay`` plays it through ``kvlab.engine.Engine`` as a closed loop (``Engine.run``'s ``follow_up``): each
turn's prompt is the conversation so far, the generated replies included, so a prefix cache sees what a real one
would. A ``Fix`` is what a team can ship without touching the model: prefix caching, a KV dtype, a window with sinks,
a session cap (``kvlab.measure.session.turns_to_drop``, the rule ``kvlab.measure.session.ChatSession`` applies).

The same trace plays at two scales, through the same engine:

- **At scale** (``at_scale``): a real model on a GPU, timed by ``SimulatedClock`` from the bytes and FLOPs each
  call reads and computes. No model runs: the engine's scheduler alone plans every step (blocks, prefix hashes,
  preemption) and builds no tensor, so chats past 30k tokens replay in seconds. Each reply is a run of the
  engine's ``PLACEHOLDER_TOKEN`` (prefix hashes still tell sessions apart: a block's hash covers everything before
  it). The pool holds what the GPU's memory holds beside the weights (``pool_tokens``).
- **On the checkpoint** (``quality``): the shipped ``kvlab-tiny-stdlib`` on this CPU, real clock, the chats shrunk by
  ``SCALE`` into the 512 tokens it was trained on (the fix's window and cap shrink with them), with a passkey
  planted ``horizon`` tokens before the last turn, which asks for it. Recall says what the fix forgot; perplexity
  of held-out text through the fix's cache says what it blurred.

``Incident`` holds the service's numbers (model, GPU, SLO, quality floor) and ``Incident.judge`` applies both.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache, partial

import torch

from kvlab.cache.policy.window import WindowKVCache
from kvlab.course.disk_memo import remembered
from kvlab.engine import Engine
from kvlab.engine.clock import Clock, SimulatedClock
from kvlab.engine.request import Request, RunReport
from kvlab.measure.quality import default_cache, perplexity
from kvlab.measure.session import turns_to_drop
from kvlab.metrics import latency_summaries
from kvlab.model.decoder import Decoder
from kvlab.model.pretrained import heldout_tokens, load_pretrained
from kvlab.model.tokenizer import ASK, N_PASSKEYS, PASSKEY_BASE
from kvlab.roofline import kv_bytes_per_token, weight_bytes
from kvlab.spec.config import ModelConfig
from kvlab.spec.dtypes import KV_DTYPES, canonical_dtype
from kvlab.spec.presets import GPU, get_gpu, get_model
from kvlab.spec.validation import require_int

SCALE = 80  # at-scale tokens per checkpoint token: a 40k-token chat becomes 500, within the checkpoint's trained 512
# Tokens per block: the checkpoint's pool uses vLLM's default; at scale, blocks of 64 (as TensorRT-LLM's can be)
# keep the per-step block tables of 30k-token rows short enough to replay a trace in seconds.
BLOCK_SIZE, BLOCK_SIZE_AT_SCALE = 16, 64
ATTENTION_SINKS = 4  # StreamingLLM's count: the first tokens that soak up attention, kept whole at any scale


# -- the trace ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChatTurn:
    """A user message (token ids), the length of the reply it gets, and the pause before it is sent (seconds after
    the previous reply ended; the first turn's is after its session starts)."""

    user: tuple[int, ...]
    reply_tokens: int
    think_s: float


@dataclass(frozen=True)
class TraceSession:
    start_s: float
    turns: tuple[ChatTurn, ...]


@dataclass(frozen=True)
class ChatTrace:
    """Sessions sharing one system prompt. ``tokens_at_end(s)``: session ``s``'s context after its last reply."""

    system: tuple[int, ...]
    sessions: tuple[TraceSession, ...]

    def tokens_at_end(self, s: int) -> int:
        return len(self.system) + sum(len(t.user) + t.reply_tokens for t in self.sessions[s].turns)

    @property
    def n_turns(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


@dataclass(frozen=True)
class TraceShape:
    """How a trace is drawn: ``sessions`` starting at a Poisson ``session_rate`` (per s), each of ``turns`` turns;
    user messages and replies of lengths drawn uniformly from the ranges (tokens), think times from ``think_s``."""

    sessions: int
    turns: int
    system_tokens: int
    user_tokens: tuple[int, int]
    reply_tokens: tuple[int, int]
    think_s: tuple[float, float]
    session_rate: float

    def __post_init__(self) -> None:
        for name in ("sessions", "turns", "system_tokens"):
            require_int(name, getattr(self, name), 1)
        for name in ("user_tokens", "reply_tokens"):
            lo, hi = getattr(self, name)
            require_int(f"{name}[0]", lo, 1)
            require_int(f"{name}[1]", hi, lo)
        if not 0 <= self.think_s[0] <= self.think_s[1]:
            raise ValueError(f"think_s: {self.think_s!r}; allowed: (low, high) seconds with 0 <= low <= high")
        if not self.session_rate > 0:
            raise ValueError(f"session_rate: {self.session_rate!r}; allowed: sessions per second > 0")

    def scaled(self, factor: int) -> TraceShape:
        """Every token count and time divided by ``factor`` (at least 1 token each): the same chats, ``factor`` times
        shorter and ``factor`` times faster (a CPU replay of the checkpoint then waits milliseconds, not seconds)."""

        def down(n: int) -> int:
            return max(1, round(n / factor))

        return replace(
            self,
            system_tokens=down(self.system_tokens),
            user_tokens=(down(self.user_tokens[0]), down(self.user_tokens[1])),
            reply_tokens=(down(self.reply_tokens[0]), down(self.reply_tokens[1])),
            think_s=(self.think_s[0] / factor, self.think_s[1] / factor),
            session_rate=self.session_rate * factor,
        )


def chat_trace(shape: TraceShape, seed: int, text: Sequence[int] | torch.Tensor | None = None) -> ChatTrace:
    """Draw a trace: messages are slices of ``text`` (default: the shipped held-out text) at random offsets.

    Every number comes from one ``random.Random(seed)``, in a fixed order, so a seed gives the same trace on any
    machine; and ``shape.scaled(f)`` with the same seed draws the same sessions with every length divided by f.
    """
    text = (heldout_tokens() if text is None else torch.as_tensor(text)).tolist()
    rng = random.Random(f"kvlab-incident:{seed}")

    def piece(n: int) -> tuple[int, ...]:
        start = rng.randrange(len(text))
        return tuple(text[(start + i) % len(text)] for i in range(n))

    system = piece(shape.system_tokens)
    sessions, start = [], 0.0
    for _ in range(shape.sessions):
        start += rng.expovariate(shape.session_rate)
        turns = []
        for _ in range(shape.turns):
            n_user = rng.randint(*shape.user_tokens)
            n_reply = rng.randint(*shape.reply_tokens)
            think = rng.uniform(*shape.think_s)
            turns.append(ChatTurn(piece(n_user), n_reply, think))
        sessions.append(TraceSession(start, tuple(turns)))
    return ChatTrace(system, tuple(sessions))


# -- the fix -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fix:
    """What the team ships: each field a cache lever the engine has, in tokens at the incident's scale.

    ``Fix()`` is what the service runs before the incident: vLLM's defaults, prefix caching on (its V1 engine's
    default) and KV in the model's dtype, no window, no cap.

    ``kv_dtype``: what the KV blocks store (``kvlab.spec.dtypes.KV_DTYPES``; ``None``: the model's own dtype).
    ``window`` + ``sinks``: each request keeps its first ``sinks`` and its ``window`` most recent tokens.
    ``session_cap``: before a turn would take a conversation past this many tokens, its oldest turns are dropped
    (the system prompt stays), so the next prompt is shorter and must be prefilled again from the system prompt on.
    """

    prefix_caching: bool = True
    kv_dtype: str | None = None
    window: int | None = None
    sinks: int = 0
    session_cap: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.prefix_caching, bool):
            raise ValueError(f"prefix_caching: {self.prefix_caching!r}; allowed: True or False")
        if self.kv_dtype is not None:
            object.__setattr__(self, "kv_dtype", canonical_dtype(self.kv_dtype, "kv_dtype", KV_DTYPES))
        if self.window is not None:
            require_int("window", self.window, 1)
        require_int("sinks", self.sinks, 0)
        if self.sinks and self.window is None:
            raise ValueError(f"sinks: {self.sinks} without a window; allowed: 0, or a window (an integer >= 1) too")
        if self.session_cap is not None:
            require_int("session_cap", self.session_cap, 1)

    def scaled(self, factor: int, horizon: int) -> Fix:
        """The same fix for chats ``factor`` times shorter, whose fact to recall lies ``horizon // factor`` tokens
        back instead of ``horizon``: every length divided by ``factor`` (at least 1).

        - The window is divided about the horizon, ``horizon // factor + ceil((window - horizon) / factor)``, so
          that it is wider than the scaled horizon exactly when it was wider than ``horizon`` (a plain rounding
          would make a window a few tokens wider than 8,192 narrower than 8,192 / 80 rounded down).
        - Sinks are divided too, but never below ``min(sinks, ATTENTION_SINKS)``: a few sink tokens are what the
          attention-sink effect needs at any length, while a thousand are a share of the chat.
        """
        window = None
        if self.window is not None:
            window = max(1, horizon // factor + math.ceil((self.window - horizon) / factor))
        return replace(
            self,
            window=window,
            sinks=max(min(self.sinks, ATTENTION_SINKS), round(self.sinks / factor)),
            session_cap=None if self.session_cap is None else max(1, round(self.session_cap / factor)),
        )

    def describe(self) -> str:
        parts = ["prefix cache" if self.prefix_caching else "no prefix cache"]
        parts.append(f"KV {self.kv_dtype or 'as the model'}")
        if self.window is not None:
            parts.append(f"window {self.window:,} + {self.sinks} sinks")
        if self.session_cap is not None:
            parts.append(f"session cap {self.session_cap:,}")
        return ", ".join(parts)


# -- the replay --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TurnRecord:
    """Which session and turn a request was, when it was sent (clock seconds), how long its prompt was, and how many
    old turns the cap dropped before it."""

    session: int
    turn: int
    arrival_s: float
    prompt_tokens: int
    dropped_turns: int


@dataclass(frozen=True)
class Replay:
    """A trace played through the engine: ``report.results[i]`` is the request ``turns[i]`` describes."""

    report: RunReport
    turns: tuple[TurnRecord, ...]
    fix: Fix

    def answers(self) -> dict[int, int]:
        """Each session's last reply's first token (the passkey runs ask for it there). A session's turns are
        recorded in order, each after the reply it follows, so the last one recorded wins."""
        last = {}
        for record, result in zip(self.turns, self.report.results, strict=True):
            if result.output_ids:
                last[record.session] = result.output_ids[0]
        return last

    def contexts_at(self, t_s: float) -> list[int]:
        """The contexts of the requests decoding at clock time ``t_s`` (after their first token, before their last),
        each its prompt plus the tokens generated by then: the ragged batch a decode step at ``t_s`` read."""
        rows = []
        for record, result in zip(self.turns, self.report.results, strict=True):
            times = () if result.timing is None else result.timing.token_times_s
            if len(times) > 1 and record.arrival_s + times[0] <= t_s < record.arrival_s + times[-1]:
                generated = sum(record.arrival_s + t <= t_s for t in times)
                rows.append(record.prompt_tokens + generated - 1)  # the newest token is not stored yet
        return rows


def replay(
    trace: ChatTrace,
    fix: Fix,
    model: Decoder | None,
    *,
    n_blocks: int,
    block_size: int = BLOCK_SIZE,
    clock: str | Clock = "real",
    max_batch: int = 32,
    token_budget: int = 2048,
) -> Replay:
    """Play ``trace`` through an ``Engine`` over ``model`` (None: no model, with a ``SimulatedClock``) with ``fix``'s
    levers (module docstring)."""
    if not isinstance(fix, Fix):
        raise ValueError(f"fix: {fix!r}; allowed: a kvlab.course.incident.Fix")
    if fix.session_cap is not None:
        longest = max(len(t.user) + t.reply_tokens for s in trace.sessions for t in s.turns)
        if fix.session_cap < len(trace.system) + longest:
            raise ValueError(
                f"session_cap: {fix.session_cap} tokens cannot hold the system prompt ({len(trace.system)}) and the "
                f"longest turn ({longest}); allowed: at least {len(trace.system) + longest}"
            )
    engine = Engine(
        model,
        n_blocks=n_blocks,
        block_size=block_size,
        kv_dtype=fix.kv_dtype,
        window=fix.window,
        sinks=fix.sinks,
        max_batch=max_batch,
        token_budget=token_budget,
        prefix_caching=fix.prefix_caching,
        clock=clock,
    )
    kept: list[list[tuple[int, ...]]] = [[] for _ in trace.sessions]  # per session: its kept turns' tokens
    history = [list(trace.system) for _ in trace.sessions]  # per session: the system prompt and its kept turns
    records: list[TurnRecord] = []

    def request(s: int, k: int, after_s: float) -> Request:
        turn = trace.sessions[s].turns[k]
        dropped = 0
        if fix.session_cap is not None:
            dropped = turns_to_drop(
                len(trace.system), [len(t) for t in kept[s]], len(turn.user) + turn.reply_tokens, fix.session_cap
            )
            if dropped:
                del kept[s][:dropped]
                history[s] = [*trace.system, *(t for old in kept[s] for t in old)]
        prompt = (*history[s], *turn.user)
        records.append(TurnRecord(s, k, after_s + turn.think_s, len(prompt), dropped))
        return Request(prompt, turn.reply_tokens, after_s + turn.think_s)

    def follow_up(index: int, output: list[int], finish_s: float) -> list[Request]:
        s, k = records[index].session, records[index].turn
        kept[s].append((*trace.sessions[s].turns[k].user, *output))
        history[s].extend(kept[s][-1])
        return [request(s, k + 1, finish_s)] if k + 1 < len(trace.sessions[s].turns) else []

    first = [request(s, 0, session.start_s) for s, session in enumerate(trace.sessions)]
    report = engine.run(first, follow_up)
    return Replay(report, tuple(records), fix)


def pool_tokens(cfg: ModelConfig, gpu: str | GPU, kv_dtype: str | None = None, utilization: float = 0.9) -> int:
    """Tokens of KV a GPU holds beside the weights: ``utilization`` of its memory (vLLM's
    ``gpu_memory_utilization``, default 0.9) less ``weight_bytes(cfg)``, over ``kv_bytes_per_token(cfg, kv_dtype)``,
    rounded down. ``ValueError`` if the weights alone do not fit."""
    spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization: {utilization!r}; allowed: a fraction in (0, 1]")
    free = utilization * spec.memory_gb * 1e9 - weight_bytes(cfg)
    if free <= 0:
        raise ValueError(
            f"gpu: {spec.name}'s {spec.memory_gb} GB at utilization {utilization} cannot hold {cfg.name}'s "
            f"{weight_bytes(cfg) / 1e9:.1f} GB of weights; allowed: a GPU with more memory"
        )
    return math.floor(free / kv_bytes_per_token(cfg, kv_dtype))


def at_scale(
    trace: ChatTrace,
    fix: Fix,
    cfg: ModelConfig,
    gpu: str | GPU,
    utilization: float = 0.9,
    max_batch: int = 32,
    token_budget: int = 512,
) -> Replay:
    """``trace`` replayed for ``cfg`` on ``gpu`` (simulated clock, no model, a pool of ``pool_tokens``)."""
    clock = SimulatedClock.for_gpu(cfg, gpu, fix.kv_dtype, fix.window, fix.sinks)
    n_blocks = pool_tokens(cfg, gpu, fix.kv_dtype, utilization) // BLOCK_SIZE_AT_SCALE
    return replay(
        trace,
        fix,
        None,
        n_blocks=n_blocks,
        block_size=BLOCK_SIZE_AT_SCALE,
        clock=clock,
        max_batch=max_batch,
        token_budget=token_budget,
    )


# -- quality on the checkpoint -----------------------------------------------------------------------------------
def with_passkeys(trace: ChatTrace, horizon: int, seed: int) -> tuple[ChatTrace, dict[int, int]]:
    """Each session with a passkey planted ``horizon`` tokens before its last turn's question, which ends that turn's
    user message with ``<|ask|>`` and a one-token reply; returns the trace and each session's passkey.

    The passkey replaces one token of an earlier turn's user message (counting replies at their known lengths);
    a session too short for the horizon gets it in its first user message.
    """
    require_int("horizon", horizon, 1)
    rng = random.Random(f"kvlab-incident-passkeys:{seed}")
    sessions, answers = [], {}
    for s, session in enumerate(trace.sessions):
        turns = [list(t.user) for t in session.turns]
        turns[-1][-1] = ASK
        passkey = PASSKEY_BASE + rng.randrange(N_PASSKEYS)
        back, k = 0, len(turns) - 1
        back += len(turns[k]) - 1  # from the question back to the start of the last user message
        while k > 0 and back < horizon:
            k -= 1
            back += session.turns[k].reply_tokens + len(turns[k])
        at = max(0, min(len(turns[k]) - 1, back - horizon)) if k > 0 else 0
        if k == len(turns) - 1:
            at = max(0, len(turns[k]) - 1 - horizon)
        turns[k][at] = passkey
        answers[s] = passkey
        new = [replace(t, user=tuple(u)) for t, u in zip(session.turns, turns, strict=True)]
        new[-1] = replace(new[-1], reply_tokens=1)
        sessions.append(replace(session, turns=tuple(new)))
    return ChatTrace(trace.system, tuple(sessions)), answers


def fix_cache_factory(fix: Fix):
    """``make_cache(model, batch, capacity)`` with ``fix``'s codec and window (original positions, as the engine's
    paged cache keeps them), for ``kvlab.measure.quality``; a session cap acts on turns, not inside a cache."""
    if fix.window is None:
        return lambda model, batch, capacity: model.new_cache(batch, capacity, kv_dtype=fix.kv_dtype)
    return partial(WindowKVCache.for_model, window=fix.window, sinks=fix.sinks, codec=fix.kv_dtype)


@dataclass(frozen=True)
class Quality:
    """The fix on the checkpoint: passkey recall in the chats, and held-out perplexity through its cache, each beside
    the full cache's in the same run."""

    recall: float
    ppl: float
    full_ppl: float
    replay: Replay = field(repr=False)

    @property
    def ppl_ratio(self) -> float:
        return self.ppl / self.full_ppl


def _fix_ppl(model: Decoder, small: Fix, segments: int) -> float:
    """Held-out perplexity through ``small``'s cache; a fix that keeps every token at the model's dtype reads the
    full cache, the reference every fix is divided by."""
    return _cache_ppl(model, small.kv_dtype, small.window, small.sinks, segments)


@lru_cache(maxsize=16)
def _cache_ppl(model: Decoder, kv_dtype: str | None, window: int | None, sinks: int, segments: int) -> float:
    """It depends on the cache and the text, not on a trace's seed or the fix's other levers, so it is remembered
    per model object: a lesson's check and the grader's judge the same cache on the same text. Every fix's cache
    (a codec, a window with sinks) keeps in a prefill what it would keep token by token, so each segment goes in
    one pass (``perplexity``'s ``one_pass``): the measurement of the stream, at a fiftieth of its cost."""
    context = model.cfg.max_seq_len
    small = Fix(kv_dtype=kv_dtype, window=window, sinks=sinks)
    factory = default_cache if small == Fix() else fix_cache_factory(small)
    tokens = heldout_tokens()[: segments * context]
    return perplexity(model, tokens, context, factory, progress=False, one_pass=True).ppl


@lru_cache(maxsize=16)
def _trace(shape: TraceShape, seed: int) -> ChatTrace:
    """``chat_trace`` of the shipped text, remembered: every fix replays the same traces."""
    return chat_trace(shape, seed)


@lru_cache(maxsize=32)
def _at_scale(incident: Incident, fix: Fix, seed: int) -> Replay:
    """``Incident.at_scale``, remembered: the simulated clock makes a replay a function of its fix and seed, and a
    lesson replays the same ones more than once (its plots, its check, its report); a grader's kernels share them
    on disk (``kvlab.course.disk_memo``: every submission replays today's service and the lesson's candidates)."""
    compute = partial(at_scale, incident.trace(seed), fix, incident.cfg, incident.gpu)
    return remembered("at-scale", (incident, fix, seed), compute)


@lru_cache(maxsize=16)
def _quality(incident: Incident, fix: Fix, seed: int, model: Decoder) -> Quality:
    """``Incident.quality`` on a given model object, remembered (greedy decoding: the same answer each time), in a
    grader on disk too, by the model's weights (the replay's real-clock timings are then those of the run that
    stored it)."""
    key = (incident, fix, seed, _weights_digest(model))
    return remembered("quality", key, partial(_measure_quality, incident, fix, seed, model))


@lru_cache(maxsize=4)
def _weights_digest(model: Decoder) -> str:
    """A hash of ``model``'s config and state (parameters and persistent buffers): what its greedy answers depend
    on. Non-persistent buffers are left out: they are derived, and may grow with use (RoPE's angle table)."""
    h = hashlib.sha256(repr(model.cfg).encode())
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _measure_quality(incident: Incident, fix: Fix, seed: int, model: Decoder) -> Quality:
    small = fix.scaled(SCALE, incident.horizon)
    trace, answers = with_passkeys(chat_trace(incident.shape.scaled(SCALE), seed), incident.horizon // SCALE, seed)
    longest = max(trace.tokens_at_end(s) for s in range(len(trace.sessions)))
    if longest > model.cfg.max_seq_len:
        raise ValueError(
            f"shape: a chat reaches {longest} tokens at 1/{SCALE} scale, past {incident.checkpoint}'s trained "
            f"{model.cfg.max_seq_len}; allowed: shorter chats"
        )
    n_blocks = len(trace.sessions) * (math.ceil(longest / BLOCK_SIZE) + 1)
    run = replay(trace, small, model, n_blocks=n_blocks, max_batch=len(trace.sessions))
    got = run.answers()
    recall = sum(got.get(s) == a for s, a in answers.items()) / len(answers)
    segments = incident.ppl_segments
    return Quality(recall, _fix_ppl(model, small, segments), _fix_ppl(model, Fix(), segments), run)


# -- the incident ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    """``Incident.judge``'s answer: the replay at scale against the SLOs, the checkpoint's quality against the floor."""

    p99_tpot_ms: float  # over the turns of every trace judged
    p99_ttft_ms: float
    slo_met: bool
    quality: Quality
    quality_met: bool
    trace_p99_tpot_ms: tuple[float, ...] = ()  # each trace's own P99 TPOT, in the order of the seeds judged

    @property
    def passed(self) -> bool:
        return self.slo_met and self.quality_met


@dataclass(frozen=True)
class Incident:
    """The service: ``model`` on ``gpu`` serving traffic of ``shape``, its SLOs (P99 TPOT and P99 TTFT, ms), and what
    the product must still do: recall a passkey ``horizon`` tokens back at least ``recall_floor`` of the time, with a
    perplexity at most ``1 + ppl_tolerance`` times the full cache's, measured on ``checkpoint`` at 1/``SCALE``."""

    model: str
    gpu: str
    shape: TraceShape
    slo_p99_tpot_ms: float
    slo_p99_ttft_ms: float
    horizon: int
    recall_floor: float = 0.75
    ppl_tolerance: float = 0.02
    checkpoint: str = "kvlab-tiny-stdlib"
    ppl_segments: int = 2

    @property
    def cfg(self) -> ModelConfig:
        return get_model(self.model)

    def trace(self, seed: int) -> ChatTrace:
        return _trace(self.shape, seed)

    def at_scale(self, fix: Fix, seed: int) -> Replay:
        """The trace of ``seed`` replayed with ``fix`` for ``model`` on ``gpu`` (remembered: treat it as read-only)."""
        return _at_scale(self, fix, seed)

    def quality(self, fix: Fix, seed: int, model: Decoder | None = None) -> Quality:
        """The fix, shrunk by ``SCALE``, on the checkpoint (loaded on the CPU unless given): recall over the chats of
        ``chat_trace(shape.scaled(SCALE), seed)``, perplexity over ``ppl_segments`` held-out segments of its
        trained length. Remembered per model object, as ``at_scale`` is."""
        model = load_pretrained(self.checkpoint, device="cpu") if model is None else model
        return _quality(self, fix, seed, model)

    def judge(self, fix: Fix, seeds: Sequence[int], model: Decoder | None = None) -> Verdict:
        """Both halves: the P99s at scale, over every turn of the traces of ``seeds`` together (a P99 of one trace's
        couple of hundred turns rests on its two slowest), against the SLOs; the quality, on the first seed's
        chats, against the floor."""
        if not seeds:
            raise ValueError("seeds: empty; allowed: one or more integer seeds")
        tpot, ttft, trace_tpot = self.pooled_p99(fix, seeds)
        q = self.quality(fix, seeds[0], model)
        quality_met = q.recall >= self.recall_floor and q.ppl_ratio <= 1 + self.ppl_tolerance
        slo_met = tpot <= self.slo_p99_tpot_ms and ttft <= self.slo_p99_ttft_ms
        return Verdict(tpot, ttft, slo_met, q, quality_met, trace_tpot)

    def pooled_p99(self, fix: Fix, seeds: Sequence[int]) -> tuple[float, float, tuple[float, ...]]:
        """The at-scale half of ``judge`` alone: P99 TPOT and P99 TTFT (ms) over every turn of the traces of
        ``seeds`` together, and each trace's own P99 TPOT, in the order of ``seeds``."""
        if not seeds:
            raise ValueError("seeds: empty; allowed: one or more integer seeds")
        per_trace = [self.at_scale(fix, seed).report.completed for seed in seeds]
        metrics = latency_summaries([r for turns in per_trace for r in turns])
        each = tuple(latency_summaries(turns)["p99_tpot_ms"] for turns in per_trace)
        return metrics["p99_tpot_ms"], metrics["p99_ttft_ms"], each


# The course's incident: a chat assistant on Llama 3.1 8B, one H100, whose sessions paste code and logs each turn.
INCIDENT = Incident(
    model="llama-3.1-8b",
    gpu="h100-sxm",
    shape=TraceShape(
        sessions=12,
        turns=16,
        system_tokens=2048,
        user_tokens=(1000, 2600),
        reply_tokens=(64, 192),
        think_s=(0.5, 2.0),
        session_rate=2.0,
    ),
    slo_p99_tpot_ms=15.0,
    slo_p99_ttft_ms=1000.0,
    horizon=8192,
)
PUBLIC_SEEDS = (0, 1, 2)  # the lesson's traces; the grader's are others
