"""Measure any OpenAI-compatible server the way vLLM's ``bench serve`` does: streamed tokens, timed on arrival.

    results = run_benchmark("http://127.0.0.1:8000", "kvlab-tiny-stdlib", [Prompt(ids, 64)], max_concurrency=8)
    results["median_tpot_ms"], results["p99_itl_ms"], results["output_throughput"]

Each request is a streamed ``POST /v1/completions`` (``stream: true``, greedy, ``stream_options.include_usage``)
whose prompt is a list of token ids, so its length is exact whatever the server's tokenizer. Per request, as vLLM
times it:

- TTFT: from sending the request to the first chunk that carries text;
- ITL: between successive chunks that carry text (a chunk may hold several tokens on some servers);
- E2EL: from sending to the last chunk;
- TPOT: ``(E2EL - TTFT) / (output tokens - 1)``, the output tokens counted by the server's ``usage`` when it reports
  them, else one per chunk.

The summary carries vLLM's field names (``mean_/median_/std_/p90_/p99_`` + ``ttft/tpot/itl/e2el`` + ``_ms``,
``request_throughput``, ``output_throughput``, ``total_token_throughput``, ``completed``, ...), so its JSON and
``vllm bench serve --save-result``'s can be compared line by line. Requests start all at once under
``max_concurrency``, or at Poisson arrivals of ``request_rate`` per second (both, as vLLM allows).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import pairwise

import httpx

from kvlab.bench import latency_summaries

PROMPT_ID_RANGE = (100, 200)  # plain (byte-level) tokens in every vocabulary: no special tokens, no out-of-range ids


@dataclass(frozen=True)
class Prompt:
    """One request to send: its prompt token ids and how many tokens to ask for."""

    ids: tuple[int, ...]
    max_tokens: int

    def __post_init__(self) -> None:
        if not self.ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.ids):
            raise ValueError(f"ids: {self.ids[:8]!r}...; allowed: a non-empty sequence of token ids >= 0")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: {self.max_tokens!r}; allowed: an integer >= 1")


@dataclass(frozen=True)
class RequestOutcome:
    """What one streamed request measured. Times in seconds from sending it; ``error`` set when it failed."""

    prompt_tokens: int
    output_tokens: int = 0
    chunk_times_s: tuple[float, ...] = field(default=(), repr=False)  # arrivals of the chunks that carried text
    latency_s: float = 0.0
    error: str | None = None

    @property
    def ttft_ms(self) -> float:
        return self.chunk_times_s[0] * 1e3

    @property
    def itl_ms(self) -> list[float]:
        return [(b - a) * 1e3 for a, b in pairwise(self.chunk_times_s)]

    @property
    def e2el_ms(self) -> float:
        return self.latency_s * 1e3

    @property
    def tpot_ms(self) -> float | None:
        """``None`` for a one-token output, which has no time per output token."""
        if self.output_tokens < 2:
            return None
        return (self.e2el_ms - self.ttft_ms) / (self.output_tokens - 1)


def random_prompts(n: int, input_len: int, output_len: int, seed: int = 0) -> list[Prompt]:
    """``n`` prompts of ``input_len`` random ids from ``PROMPT_ID_RANGE`` (seeded), each asking ``output_len``."""
    rng = random.Random(seed)
    lo, hi = PROMPT_ID_RANGE
    return [Prompt(tuple(rng.randrange(lo, hi) for _ in range(input_len)), output_len) for _ in range(n)]


def read_trace(path: str) -> list[Prompt]:
    """A trace file: one JSON object per line with ``input_len`` and ``output_len`` (random ids fill the prompt)."""
    prompts = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompts += random_prompts(1, int(row["input_len"]), int(row["output_len"]), seed=number)
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f"trace: {path} line {number}: {e}; allowed: one JSON object per line with integer "
                    "input_len >= 1 and output_len >= 1"
                ) from None
    if not prompts:
        raise ValueError(f"trace: {path} holds no request; allowed: one JSON object per line")
    return prompts


async def stream_one(client: httpx.AsyncClient, url: str, model: str, prompt: Prompt) -> RequestOutcome:
    """Send ``prompt`` as one streamed completion and time its chunks."""
    body = {
        "model": model,
        "prompt": list(prompt.ids),
        "max_tokens": prompt.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks: list[float] = []
    usage_tokens = None
    start = time.perf_counter()
    try:
        async with client.stream("POST", f"{url.rstrip('/')}/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return RequestOutcome(len(prompt.ids), error=f"HTTP {response.status_code}: {text[:300]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                if any(choice.get("text") for choice in event.get("choices") or ()):
                    chunks.append(time.perf_counter() - start)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return RequestOutcome(len(prompt.ids), error=f"{type(e).__name__}: {e}")
    latency = time.perf_counter() - start
    if not chunks:
        return RequestOutcome(len(prompt.ids), latency_s=latency, error="the stream carried no text")
    return RequestOutcome(len(prompt.ids), usage_tokens or len(chunks), tuple(chunks), latency)


async def _run(
    url: str,
    model: str,
    prompts: Sequence[Prompt],
    max_concurrency: int | None,
    request_rate: float,
    seed: int,
    timeout_s: float,
    transport: httpx.AsyncBaseTransport | None,
) -> tuple[list[RequestOutcome], float]:
    gate = asyncio.Semaphore(max_concurrency or len(prompts))
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=max_concurrency or len(prompts))
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, transport=transport) as client:

        async def limited(prompt: Prompt) -> RequestOutcome:
            async with gate:
                return await stream_one(client, url, model, prompt)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))  # Poisson arrivals, as vLLM's bench
        outcomes = await asyncio.gather(*tasks)
        return list(outcomes), time.perf_counter() - start


def run_benchmark(
    url: str,
    model: str,
    prompts: Sequence[Prompt],
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    seed: int = 0,
    timeout_s: float = 600.0,
    transport: httpx.AsyncBaseTransport | None = None,
) -> dict:
    """Send every prompt to ``url`` (the server's root, e.g. ``http://127.0.0.1:8000``) and summarize as vLLM does.

    ``max_concurrency``: requests in flight at most (``None``: no limit). ``request_rate``: mean requests per
    second of Poisson arrivals (``inf``: all at once). Returns vLLM's fields plus per-request lists
    (``input_lens``, ``output_lens``, ``ttfts``, ``itls``, ``errors``). ``transport``: where requests go (the
    network by default; ``httpx.ASGITransport(app)`` serves them in-process).
    """
    if not prompts:
        raise ValueError("prompts: empty; allowed: at least one Prompt")
    if max_concurrency is not None and (isinstance(max_concurrency, bool) or max_concurrency < 1):
        raise ValueError(f"max_concurrency: {max_concurrency!r}; allowed: None or an integer >= 1")
    if not request_rate > 0:
        raise ValueError(f"request_rate: {request_rate!r}; allowed: requests per second > 0, or inf")
    outcomes, duration = _run_to_completion(
        _run(url, model, prompts, max_concurrency, request_rate, seed, timeout_s, transport)
    )
    return summarize_outcomes(outcomes, duration)


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
    """``run_benchmark`` at each context length: ``num_prompts`` random prompts of that many tokens, each asking
    ``output_len``; each summary gains its ``context``. ``options``: ``run_benchmark``'s."""
    return [
        {"context": c, **run_benchmark(url, model, random_prompts(num_prompts, c, output_len, seed=c), **options)}
        for c in contexts
    ]
