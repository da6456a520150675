"""Measure any OpenAI-compatible server the way vLLM's ``bench serve`` does: streamed tokens, timed on arrival.

    results = run_benchmark("http://127.0.0.1:8000", "kvlab-tiny-stdlib", random_prompts(8, 256, 64))
    results["median_tpot_ms"], results["p99_itl_ms"], results["output_throughput"]

Each request is a streamed, greedy ``POST /v1/completions`` (or ``/v1/chat/completions`` with
``endpoint_type="chat"``) that asks for ``usage`` with ``stream_options.include_usage``. One untimed warm-up request
goes first, as vLLM's client sends, so that the client's own cold start (connection, imports) is not measured.
Per request:

- a *token chunk* is a streamed event that carries a choice, whether or not its text is empty (servers send empty
  text for special tokens and for a character split across tokens); a chat chunk that only opens the message
  (``role`` and no content) is not one;
- TTFT: from sending the request to the first token chunk;
- ITL: between successive token chunks (a chunk may hold several tokens on some servers);
- E2EL: from sending to the last token chunk (not to ``[DONE]``, which a server may send late);
- TPOT: ``(E2EL - TTFT) / (n - 1)``, with ``n`` the output tokens: the server's ``usage.completion_tokens``; failing
  that, the streamed text counted by ``tokenizer`` (vLLM's fallback); failing both, one per token chunk (the
  summary's ``output_tokens_counted_by`` says which).

A request succeeds when the server ends it normally (``[DONE]``, or a ``finish_reason`` and a closed stream), text
or not. Prompts are plain English words, never fixed token ids (low ids are control tokens in some vocabularies):
with a ``tokenizer`` they are exactly ``input_len`` of its tokens (sent as ids to completions, as text to chat);
without one they are text of ``input_len / tokens_per_char`` characters, the ratio measured from the server's
``usage.prompt_tokens`` on two short probe requests (``measure_prompt_tokens``).

The summary carries vLLM's field names (``mean_/median_/std_/p90_/p99_`` + ``ttft/tpot/itl/e2el`` + ``_ms``,
``request_throughput``, ``output_throughput``, ...), so its JSON and ``vllm bench serve --save-result``'s compare
line by line. Requests start all at once under ``max_concurrency``, or at Poisson arrivals of ``request_rate`` per
second (both, as vLLM allows).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Protocol

import httpx

from kvlab.metrics import latency_summaries
from kvlab.spec.validation import require_int

ENDPOINT_TYPES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
BACKENDS = {"openai": "completions", "vllm": "completions", "openai-chat": "chat"}  # vLLM's --backend names
VLLM_DEFAULT_INPUT_LEN = 1024  # vLLM's --random-input-len default
ASSUMED_CHARS_PER_TOKEN = 4.0  # English text in common BPE vocabularies; used only when a server reports no usage
# Common English words: every vocabulary holds them as ordinary text, unlike a fixed range of token ids.
WORDS = (  # noqa: SIM905 (a paragraph reads better than 200 quoted words)
    "the of and to in is was for that with as on by at from his her they this which one had not but all were when we "
    "there can an your their if has will each about how up out them then she many some so these would other into "
    "more two time could no make than first been its who now people my made over did down only way find use may "
    "water long little very after words called just where most know get through back much before go good new write "
    "our used me man too any day same right look think also around another came come work three must because does "
    "part even place well such here take why help put different away again off went old number great tell men say "
    "small every found still between name should home big give air line set own under read last never us left end "
    "along while might next sound below saw something thought both few those always show large often together asked "
    "house world going want school important until form food keep children feet land side without boy once animal "
    "life enough took four head above kind began almost live page got earth need far hand high year mother light"
).split()


class Tokenizer(Protocol):
    """What kvlab needs of a tokenizer: a Hugging Face tokenizer has both."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class EndpointError(RuntimeError):
    """The server could not be measured at all (the warm-up or a probe request failed); the message says why."""


def load_tokenizer(name_or_path: str) -> Tokenizer:
    """A Hugging Face tokenizer by hub name or local folder, through ``transformers`` (as vLLM's client loads it)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError(
            f"tokenizer: {name_or_path!r} needs the transformers package; allowed: pip install transformers, "
            "or no tokenizer (usage counts from the server)"
        ) from None
    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"tokenizer: {name_or_path!r}: {e}; allowed: a Hugging Face tokenizer name or folder"
        ) from None


@dataclass(frozen=True)
class Prompt:
    """One request: its prompt and how many tokens to ask for.

    The prompt is ``ids`` (token ids), ``text``, or both (made by a tokenizer: ``ids`` encode ``text``). With
    neither, the request is ``input_len`` tokens of words seeded by ``seed``, written once the server's tokens per
    character are known. ``input_len``: the prompt's length in tokens (``len(ids)`` when ids are given).
    """

    max_tokens: int
    ids: tuple[int, ...] | None = None
    text: str | None = None
    input_len: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        require_int("max_tokens", self.max_tokens, 1)
        if self.ids is not None:
            if not self.ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.ids):
                raise ValueError(f"ids: {self.ids[:8]!r}...; allowed: a non-empty sequence of token ids >= 0")
            object.__setattr__(self, "input_len", len(self.ids))
        if self.text is not None and not self.text:
            raise ValueError("text: empty; allowed: a non-empty prompt")
        if self.ids is None and self.text is None:
            require_int("input_len", self.input_len, 1, note="or give ids or text")


def words(n_chars: int, seed: int) -> str:
    """``n_chars`` characters (at least one) of seeded random words from ``WORDS``."""
    rng = random.Random(seed)
    out: list[str] = []
    length = -1
    while length < n_chars:
        out.append(rng.choice(WORDS))
        length += len(out[-1]) + 1
    return " ".join(out)[: max(n_chars, 1)]


def exact_prompt(tokenizer: Tokenizer, input_len: int, max_tokens: int, seed: int) -> Prompt:
    """A prompt of words that ``tokenizer`` encodes (without special tokens) to exactly ``input_len`` tokens, where
    cutting at a token boundary allows it (a cut that merges on re-encoding is moved, up to 8 times)."""
    n_chars = 8 * input_len + 16
    while len(source := tokenizer.encode(words(n_chars, seed), add_special_tokens=False)) < 2 * input_len:
        n_chars *= 2  # a vocabulary of long tokens
    k = input_len
    for _ in range(8):
        text = tokenizer.decode(source[:k])
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == input_len:
            break
        k += input_len - len(ids)
    return Prompt(max_tokens, ids=tuple(ids), text=text)


def random_prompts(
    n: int, input_len: int, output_len: int, seed: int = 0, tokenizer: Tokenizer | None = None
) -> list[Prompt]:
    """``n`` prompts of ``input_len`` tokens of seeded random words, each asking ``output_len``: exact in
    ``tokenizer``'s tokens when given, else sized from the server's tokens per character when they are sent."""
    seeds = [random.Random(seed).randrange(2**31) + i for i in range(n)]
    if tokenizer is not None:
        return [exact_prompt(tokenizer, input_len, output_len, s) for s in seeds]
    return [Prompt(output_len, input_len=input_len, seed=s) for s in seeds]


def read_trace(path: str, tokenizer: Tokenizer | None = None) -> list[Prompt]:
    """A trace file: one JSON object per line with ``input_len`` and ``output_len`` (random words fill the prompt)."""
    prompts = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompts += random_prompts(1, int(row["input_len"]), int(row["output_len"]), number, tokenizer)
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f"trace: {path} line {number}: {e}; allowed: one JSON object per line with integer "
                    "input_len >= 1 and output_len >= 1"
                ) from None
    if not prompts:
        raise ValueError(f"trace: {path} holds no request; allowed: one JSON object per line")
    return prompts


@dataclass(frozen=True)
class RequestOptions:
    """How each request is sent and its output counted (see the module docstring)."""

    endpoint_type: str = "completions"
    ignore_eos: bool = False
    tokenizer: Tokenizer | None = None
    include_usage: bool = True

    def __post_init__(self) -> None:
        if self.endpoint_type not in ENDPOINT_TYPES:
            raise ValueError(f"endpoint_type: {self.endpoint_type!r}; allowed: {', '.join(ENDPOINT_TYPES)}")


def request_body(model: str, prompt: Prompt, options: RequestOptions, stream: bool = True) -> dict:
    """The JSON body vLLM's ``openai``/``openai-chat`` clients send for ``prompt`` (greedy)."""
    chat = options.endpoint_type == "chat"
    if chat and prompt.text is None:
        raise ValueError("prompt: token ids only; allowed: text prompts for chat (give a tokenizer, or no ids)")
    body: dict = {"model": model, "temperature": 0, "max_tokens": prompt.max_tokens, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt.text}]
        body["max_completion_tokens"] = prompt.max_tokens  # the current name; max_tokens for older servers
    else:
        body["prompt"] = list(prompt.ids) if prompt.ids is not None else prompt.text
    if stream and options.include_usage:
        body["stream_options"] = {"include_usage": True}
    if options.ignore_eos:
        body["ignore_eos"] = True
    return body


@dataclass(frozen=True)
class RequestOutcome:
    """What one streamed request measured. Times in seconds from sending it; ``error`` set when it failed.
    ``counted_by``: where ``output_tokens`` came from: ``usage``, ``tokenizer`` or ``chunks``."""

    prompt_tokens: int
    output_tokens: int = 0
    chunk_times_s: tuple[float, ...] = field(default=(), repr=False)  # arrivals of the token chunks
    error: str | None = None
    counted_by: str = "usage"

    @property
    def ttft_ms(self) -> float:
        return self.chunk_times_s[0] * 1e3

    @property
    def itl_ms(self) -> list[float]:
        return [(b - a) * 1e3 for a, b in pairwise(self.chunk_times_s)]

    @property
    def e2el_ms(self) -> float:
        return self.chunk_times_s[-1] * 1e3

    @property
    def tpot_ms(self) -> float | None:
        """``None`` for a one-token output, which has no time per output token."""
        if self.output_tokens < 2:
            return None
        return (self.e2el_ms - self.ttft_ms) / (self.output_tokens - 1)


def _token_piece(choice: dict, chat: bool) -> str | None:
    """The text a streamed choice carries (``""`` for a token without text); ``None`` for a chat chunk that only
    opens the message, which carries no token."""
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    if not piece and "role" in delta and not choice.get("finish_reason"):
        return None
    return piece


async def stream_one(
    client: httpx.AsyncClient, url: str, model: str, prompt: Prompt, options: RequestOptions = RequestOptions()
) -> RequestOutcome:
    """Send ``prompt`` as one streamed request to the server at ``url`` (its root) and time its token chunks."""
    chat = options.endpoint_type == "chat"
    body = request_body(model, prompt, options)
    times: list[float] = []
    pieces: list[str] = []
    usage: dict = {}
    ended = False
    opener = None  # arrival of a chat chunk with a role and no text: an opener (vLLM) or a text-less first token
    prompt_len = prompt.input_len or 0
    start = time.perf_counter()
    try:
        async with client.stream("POST", url + ENDPOINT_TYPES[options.endpoint_type], json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return RequestOutcome(prompt_len, error=f"HTTP {response.status_code}: {text[:300]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    ended = True
                    break
                arrival = time.perf_counter() - start
                event = json.loads(data)
                if not isinstance(event, dict):
                    continue
                if event.get("error"):
                    return RequestOutcome(prompt_len, error=f"the server's stream reported: {event['error']}")
                usage = event.get("usage") or usage
                choices = event.get("choices") or ()
                if choices and isinstance(choices[0], dict):
                    ended = ended or bool(choices[0].get("finish_reason"))
                    piece = _token_piece(choices[0], chat)
                    if piece is not None:
                        times.append(arrival)
                        pieces.append(piece)
                    elif not times:
                        opener = arrival
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return RequestOutcome(prompt_len, error=f"{type(e).__name__}: {e}")
    prompt_len = usage.get("prompt_tokens") or prompt_len
    if not ended:
        return RequestOutcome(prompt_len, error="the stream stopped before [DONE] or a finish_reason")
    n, counted_by = usage.get("completion_tokens"), "usage"
    if opener is not None and n == len(times) + 1:  # the usage says the role chunk carried a token too
        times.insert(0, opener)
    if not times:
        return RequestOutcome(prompt_len, error="the stream ended without a token chunk")
    if not n and options.tokenizer is not None:
        n, counted_by = len(options.tokenizer.encode("".join(pieces), add_special_tokens=False)), "tokenizer"
    if not n:
        n, counted_by = len(times), "chunks"
    return RequestOutcome(prompt_len, n, tuple(times), counted_by=counted_by)


def base_url(url: str) -> tuple[str, str | None]:
    """The server's root for ``url`` given as its root, its ``/v1`` (the openai client's base URL) or a full
    endpoint, and the endpoint type a full endpoint names (else ``None``)."""
    url = url.rstrip("/")
    for kind, path in ENDPOINT_TYPES.items():
        if url.endswith(path):
            return url[: -len(path)], kind
    return url.removesuffix("/v1"), None


async def _served_models(client: httpx.AsyncClient, url: str) -> list[dict]:
    try:
        response = await client.get(url + "/v1/models")
        data = response.json().get("data") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return []
    return [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []


@dataclass(frozen=True)
class ServerFacts:
    """What two short probe requests and ``GET /v1/models`` tell about a server.

    ``max_model_len``: its context, when ``/v1/models`` gives it. ``tokens_per_char``: prompt tokens per character of
    ``words`` text, the slope of ``usage.prompt_tokens`` between two prompt lengths (``None``: no usage reported).
    ``overhead_tokens``: what the server adds to every prompt (BOS, a chat template), the line's intercept.
    """

    max_model_len: int | None
    tokens_per_char: float | None
    overhead_tokens: int = 0

    def prompt_chars(self, input_len: int) -> int:
        """Characters of ``words`` text that make about ``input_len`` tokens on this server."""
        return max(1, round(input_len / (self.tokens_per_char or 1 / ASSUMED_CHARS_PER_TOKEN)))

    def default_input_len(self, output_len: int, exact: bool) -> int:
        """vLLM's 1024, or less where the server's context would not hold it with ``output_len``, the prompt's
        overhead and (for prompts sized in characters, not ``exact``) 10% for the approximation."""
        if self.max_model_len is None:
            return VLLM_DEFAULT_INPUT_LEN
        room = self.max_model_len - output_len - self.overhead_tokens
        room = room if exact else math.floor(0.9 * room)
        if room < 1:
            raise ValueError(
                f"output_len: {output_len}; allowed: fewer than the served context {self.max_model_len} minus the "
                f"prompt ({self.overhead_tokens} tokens of overhead and at least one of its own)"
            )
        return min(VLLM_DEFAULT_INPUT_LEN, room)

    def require_fit(self, input_lens: Sequence[int], output_len: int, name: str) -> None:
        """Raise ``ValueError`` naming ``name`` where a prompt of ``input_lens`` and ``output_len`` tokens would
        exceed the served context (when ``/v1/models`` gives it), instead of a run of refused requests."""
        if self.max_model_len is None:
            return
        too_long = [n for n in input_lens if n + output_len > self.max_model_len]
        if too_long:
            raise ValueError(
                f"{name}: {', '.join(map(str, too_long))} with --output-len {output_len}; allowed: at most "
                f"{self.max_model_len - output_len} (the served max_model_len is {self.max_model_len})"
            )


async def _probe(client: httpx.AsyncClient, url: str, model: str, options: RequestOptions) -> ServerFacts:
    models = await _served_models(client, url)
    lengths = [m.get("max_model_len") for m in models if m.get("id") == model]
    max_len = lengths[0] if lengths and isinstance(lengths[0], int) and lengths[0] > 1 else None
    # Two lengths far enough apart for a slope, that fit the context (a character of English words is at most one
    # token) or, where it is not given, any served model's.
    long = min(2000, max_len // 2) if max_len else 400
    counts = []
    for chars in (long // 2, long):
        body = request_body(model, Prompt(1, text=words(chars, seed=chars)), options, stream=False)
        try:
            response = await client.post(url + ENDPOINT_TYPES[options.endpoint_type], json=body)
        except httpx.HTTPError as e:
            raise EndpointError(f"probe request: {type(e).__name__}: {e}") from None
        if response.status_code != 200:
            raise EndpointError(f"probe request: HTTP {response.status_code}: {response.text[:300]}")
        try:
            counts.append((len(words(chars, seed=chars)), response.json()["usage"]["prompt_tokens"]))
        except (ValueError, KeyError, TypeError):
            return ServerFacts(max_len, None)
    (c1, t1), (c2, t2) = counts
    if not (isinstance(t1, int) and isinstance(t2, int) and t2 > t1 and c2 > c1):
        return ServerFacts(max_len, None)
    slope = (t2 - t1) / (c2 - c1)
    return ServerFacts(max_len, slope, max(0, round(t1 - slope * c1)))


def measure_prompt_tokens(
    url: str,
    model: str,
    options: RequestOptions = RequestOptions(),
    timeout_s: float = 600.0,
    transport: httpx.AsyncBaseTransport | None = None,
) -> ServerFacts:
    """``ServerFacts`` of the server at ``url``: two short non-streamed requests and ``GET /v1/models``."""

    async def probe() -> ServerFacts:
        async with httpx.AsyncClient(timeout=timeout_s, transport=transport) as client:
            return await _probe(client, base_url(url)[0], model, options)

    return _run_to_completion(probe())


async def _run(
    url: str,
    model: str,
    prompts: Sequence[Prompt],
    max_concurrency: int | None,
    request_rate: float,
    seed: int,
    timeout_s: float,
    transport: httpx.AsyncBaseTransport | None,
    options: RequestOptions,
    facts: ServerFacts | None,
) -> tuple[list[RequestOutcome], float, RequestOptions, ServerFacts | None]:
    gate = asyncio.Semaphore(max_concurrency or len(prompts))
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=max_concurrency or len(prompts))
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, transport=transport) as client:
        if facts is None and any(p.ids is None and p.text is None for p in prompts):
            facts = await _probe(client, url, model, options)
        prompts = [
            replace(p, text=words(facts.prompt_chars(p.input_len), p.seed)) if p.ids is None and p.text is None else p
            for p in prompts
        ]
        options = await _warm_up(client, url, model, prompts[0], options)

        async def limited(prompt: Prompt) -> RequestOutcome:
            async with gate:
                return await stream_one(client, url, model, prompt, options)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))  # Poisson arrivals, as vLLM's bench
        outcomes = await asyncio.gather(*tasks)
        return list(outcomes), time.perf_counter() - start, options, facts


async def _warm_up(
    client: httpx.AsyncClient, url: str, model: str, prompt: Prompt, options: RequestOptions
) -> RequestOptions:
    """Send ``prompt`` once, untimed (vLLM's "initial test run"), and return the options that worked: without
    ``stream_options`` where the server refuses that field."""
    outcome = await stream_one(client, url, model, prompt, options)
    if outcome.error and "stream_options" in outcome.error and outcome.error.startswith("HTTP 4"):
        options = replace(options, include_usage=False)
        outcome = await stream_one(client, url, model, prompt, options)
    if outcome.error:
        raise EndpointError(f"the warm-up request failed: {outcome.error}")
    return options


def run_benchmark(
    url: str,
    model: str,
    prompts: Sequence[Prompt],
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    seed: int = 0,
    timeout_s: float = 600.0,
    transport: httpx.AsyncBaseTransport | None = None,
    options: RequestOptions = RequestOptions(),
    facts: ServerFacts | None = None,
) -> dict:
    """Send every prompt to ``url`` (the server's root or its ``/v1``) and summarize as vLLM does.

    ``max_concurrency``: requests in flight at most (``None``: no limit). ``request_rate``: mean requests per
    second of Poisson arrivals (``inf``: all at once). ``options``: chat or completions, ``ignore_eos``, the
    tokenizer that counts output without ``usage``. ``facts``: the server's tokens per character, for prompts
    given by length only (``None``: probed when needed). Returns vLLM's fields plus per-request lists
    (``input_lens``, ``output_lens``, ``ttfts``, ``itls``, ``errors``), ``output_tokens_counted_by`` and
    ``prompt_tokens_per_char``. ``transport``: where requests go (the network by default;
    ``httpx.ASGITransport(app)`` serves them in-process). Raises ``EndpointError`` when the warm-up request fails.
    """
    if not prompts:
        raise ValueError("prompts: empty; allowed: at least one Prompt")
    if max_concurrency is not None and (isinstance(max_concurrency, bool) or max_concurrency < 1):
        raise ValueError(f"max_concurrency: {max_concurrency!r}; allowed: None or an integer >= 1")
    if not request_rate > 0:
        raise ValueError(f"request_rate: {request_rate!r}; allowed: requests per second > 0, or inf")
    root = base_url(url)[0]
    outcomes, duration, options, facts = _run_to_completion(
        _run(root, model, prompts, max_concurrency, request_rate, seed, timeout_s, transport, options, facts)
    )
    out = summarize_outcomes(outcomes, duration)
    out["endpoint_type"] = options.endpoint_type
    out["prompt_tokens_per_char"] = facts.tokens_per_char if facts else None
    return out


def _run_to_completion(coroutine):
    """``asyncio.run``, also from code already inside an event loop (a Jupyter cell): there, on a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def summarize_outcomes(outcomes: Sequence[RequestOutcome], duration_s: float) -> dict:
    """vLLM's ``bench serve`` summary of ``outcomes`` over a run of ``duration_s`` seconds."""
    done = [o for o in outcomes if o.error is None]
    inputs = sum(o.prompt_tokens for o in done)
    outputs = sum(o.output_tokens for o in done)
    out: dict = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "total_input_tokens": inputs,
        "total_output_tokens": outputs,
        "request_throughput": len(done) / duration_s,
        "output_throughput": outputs / duration_s,
        "total_token_throughput": (inputs + outputs) / duration_s,
        "output_tokens_counted_by": sorted({o.counted_by for o in done}),
    }
    out.update(latency_summaries(done))
    out.update(
        input_lens=[o.prompt_tokens for o in outcomes],
        output_lens=[o.output_tokens for o in outcomes],
        ttfts=[o.ttft_ms / 1e3 if o.error is None else None for o in outcomes],
        itls=[[x / 1e3 for x in o.itl_ms] for o in outcomes],
        errors=[o.error or "" for o in outcomes],
    )
    return out


def sweep_contexts(
    url: str, model: str, contexts: Sequence[int], num_prompts: int, output_len: int, **options
) -> list[dict]:
    """``run_benchmark`` at each context length: ``num_prompts`` random prompts of that many tokens (exact in the
    tokenizer of ``options["options"]`` when it has one), each asking ``output_len``; each summary gains its
    ``context``. ``options``: ``run_benchmark``'s."""
    tokenizer = options.get("options", RequestOptions()).tokenizer
    return [
        {"context": c, **run_benchmark(url, model, random_prompts(num_prompts, c, output_len, c, tokenizer), **options)}
        for c in contexts
    ]
