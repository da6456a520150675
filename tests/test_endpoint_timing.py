"""``kvlab bench --endpoint``'s latencies against a scripted server whose truth is known exactly, and beside a
replica of how vLLM's benchmark client measures the same streams (to show where the two agree and where, by
definition, they differ).

The replica follows vLLM's ``benchmarks/backend_request_func.py`` (``async_request_openai_completions`` and
``..._chat_completions``) and ``calculate_metrics`` in ``benchmark_serving.py``: every chunk with ``choices`` is a
token arrival (TTFT at the first, ITL between them); ``usage`` is read from a chunk without ``choices``; the output
count is ``usage.completion_tokens``, else the tokenizer's count of the text; the latency ends at the last chunk
with ``choices`` (current versions) or after ``[DONE]`` (older ones); TPOT = (latency - TTFT) / (n - 1).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import pytest

from kvlab.serving.client import (
    RequestOptions,
    ServerFacts,
    load_tokenizer,
    random_prompts,
    request_body,
    run_benchmark,
)

from .helpers import run_cli
from .scripted_sse import Script, ScriptedServer, save_word_tokenizer, scripted_server

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # every test streams real seconds on an exact schedule

N_PROMPTS, CONCURRENCY = 8, 4
RTOL = 0.05  # the brief's agreement: 5% on mean TPOT and ITL
WORD_PROMPTS = ServerFacts(None, tokens_per_char=0.25)  # prompts sized without a probe; lengths do not matter here


@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedServer]:
    with scripted_server() as s:
        yield s


def kvlab_bench(server: ScriptedServer, script: Script, options: RequestOptions | None = None, prompts=None):
    options = options or RequestOptions()
    prompts = prompts or random_prompts(N_PROMPTS, 16, script.n_tokens)
    return run_benchmark(
        server.url + "/v1", "scripted", prompts, max_concurrency=CONCURRENCY, options=options, facts=WORD_PROMPTS
    )


async def _vllm_request(client: httpx.AsyncClient, url: str, body: dict, chat: bool, latency_at_done: bool) -> dict:
    ttft, itl, text, output_tokens = 0.0, [], "", None
    start = most_recent = time.perf_counter()
    async with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            line = line.strip()
            if not line:
                continue
            chunk = line.removeprefix("data: ")
            if chunk == "[DONE]":
                continue
            data = json.loads(chunk)
            if choices := data.get("choices"):
                now = time.perf_counter()
                if ttft == 0.0:
                    ttft = now - start
                else:
                    itl.append(now - most_recent)
                most_recent = now
                text += (choices[0]["delta"].get("content") if chat else choices[0].get("text")) or ""
            elif usage := data.get("usage"):
                output_tokens = usage.get("completion_tokens")
    latency = (time.perf_counter() if latency_at_done else most_recent) - start
    return {"ttft": ttft, "itl": itl, "latency": latency, "output_tokens": output_tokens, "text": text}


def vllm_bench(server: ScriptedServer, script: Script, chat=False, tokenizer=None, latency_at_done=False) -> dict:
    """The replica's ``mean_tpot_ms``, ``mean_itl_ms``, ``mean_ttft_ms``, ``mean_e2el_ms``, ``output_lens``."""
    options = RequestOptions("chat" if chat else "completions")
    prompts = [replace(p, text="the " * 16) for p in random_prompts(N_PROMPTS, 16, script.n_tokens)]
    url = server.url + ("/v1/chat/completions" if chat else "/v1/completions")

    async def run() -> list[dict]:
        gate = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(timeout=60) as client:
            await _vllm_request(client, url, request_body("scripted", prompts[0], options), chat, latency_at_done)

            async def one(prompt) -> dict:
                async with gate:
                    body = request_body("scripted", prompt, options)
                    return await _vllm_request(client, url, body, chat, latency_at_done)

            return await asyncio.gather(*(one(p) for p in prompts))

    outputs = asyncio.run(run())
    lens, tpots, itls = [], [], []
    for o in outputs:
        n = o["output_tokens"]
        if not n and tokenizer is not None:  # the later upstream rule
            n = len(tokenizer(o["text"], add_special_tokens=False).input_ids)
        lens.append(n)
        if n and n > 1:
            tpots.append((o["latency"] - o["ttft"]) / (n - 1))
        itls += o["itl"]
    return {
        "output_lens": lens,
        "mean_tpot_ms": 1e3 * sum(tpots) / len(tpots) if tpots else math.nan,
        "mean_itl_ms": 1e3 * sum(itls) / len(itls),
        "mean_ttft_ms": 1e3 * sum(o["ttft"] for o in outputs) / len(outputs),
        "mean_e2el_ms": 1e3 * sum(o["latency"] for o in outputs) / len(outputs),
    }


def paired(server: ScriptedServer, script: Script, kvlab: dict, *vllm: dict) -> list[dict]:
    """kvlab bench (``kvlab``: ``kvlab_bench``'s arguments) and each vLLM replica (``vllm_bench``'s) against
    ``script`` at the same time, as the review paired them: a stall of this loaded host then hits all alike."""
    server.use(script)
    with ThreadPoolExecutor(1 + len(vllm)) as pool:
        runs = [pool.submit(kvlab_bench, server, script, **kvlab)]
        runs += [pool.submit(vllm_bench, server, script, **v) for v in vllm]
        return [run.result() for run in runs]


def assert_truth(result: dict, script: Script) -> None:
    """kvlab's means equal the scripted truth: TPOT and ITL within 5%; TTFT and E2EL never below it (a chunk cannot
    arrive before it is sent) and less than a quarter of the stream's decode time above it (loopback, and both ends
    sharing a loaded host's CPUs). A TTFT or E2EL taken at another event than the right chunk (the usage event,
    ``[DONE]`` after a tail) lands further off; one taken a chunk late shows in the count of ITL gaps."""
    assert result["completed"] == N_PROMPTS and result["output_lens"] == [script.n_tokens] * N_PROMPTS
    assert all(len(gaps) == script.chunks - 1 for gaps in result["itls"])
    assert result["mean_tpot_ms"] == pytest.approx(script.tpot_ms, rel=RTOL)
    assert result["mean_itl_ms"] == pytest.approx(script.itl_ms, rel=RTOL)
    slack = (script.e2el_ms - script.ttft_ms) / 4
    for name, truth in (("ttft", script.ttft_ms), ("e2el", script.e2el_ms)):
        assert truth - 1 <= result[f"mean_{name}_ms"] <= truth + slack, name


def assert_agree(kvlab: dict, vllm: dict) -> None:
    assert kvlab["mean_tpot_ms"] == pytest.approx(vllm["mean_tpot_ms"], rel=RTOL)
    assert kvlab["mean_itl_ms"] == pytest.approx(vllm["mean_itl_ms"], rel=RTOL)


def test_usage_and_one_token_per_chunk_both_clients_get_the_truth(server: ScriptedServer) -> None:
    script = Script()
    kvlab, vllm = paired(server, script, {}, {})
    assert_truth(kvlab, script)
    assert kvlab["output_tokens_counted_by"] == ["usage"]
    assert_agree(kvlab, vllm)


def test_tokens_streamed_with_empty_text_are_tokens_not_failures(server: ScriptedServer) -> None:
    script = Script(text=False)
    kvlab, vllm = paired(server, script, {}, {})
    assert kvlab["failed"] == 0
    assert_truth(kvlab, script)
    assert_agree(kvlab, vllm)


def test_e2el_ends_at_the_last_token_not_at_a_late_done(server: ScriptedServer) -> None:
    script = Script(tail_s=0.3)
    kvlab, vllm, old = paired(server, script, {}, {}, {"latency_at_done": True})
    assert_truth(kvlab, script)
    assert_agree(kvlab, vllm)  # current vLLM: latency at the last chunk with choices
    # Older vLLM timed the latency to [DONE]: its TPOT carries the tail spread over n - 1 tokens.
    late = script.tail_s * 1e3 / (script.n_tokens - 1)
    assert old["mean_tpot_ms"] == pytest.approx(kvlab["mean_tpot_ms"] + late, rel=RTOL)


def test_a_chat_role_opener_is_not_a_token_for_kvlab_but_is_for_vllm(server: ScriptedServer) -> None:
    script = Script(role_opener=True)
    kvlab, vllm = paired(server, script, {"options": RequestOptions("chat")}, {"chat": True})
    assert_truth(kvlab, script)
    assert all("messages" in b and b["max_completion_tokens"] == script.n_tokens for b in server.bodies())
    # vLLM's client times the role-only chunk, sent at once, as the first token: TTFT near 0, and that first gap
    # lands in its ITL and TPOT. The definitions differ here; the later gaps agree.
    assert vllm["mean_ttft_ms"] < kvlab["mean_ttft_ms"] - 0.5 * script.ttft_ms
    assert vllm["mean_tpot_ms"] == pytest.approx(script.e2el_ms / (script.n_tokens - 1), rel=0.1)


def test_usage_on_the_last_token_chunk_is_read_by_kvlab_not_by_vllm(server: ScriptedServer) -> None:
    script = Script(tokens_per_chunk=2, usage_on_last_chunk=True)
    kvlab, vllm = paired(server, script, {}, {})
    assert kvlab["output_tokens_counted_by"] == ["usage"]
    assert_truth(kvlab, script)
    # vLLM's client looks for usage only in a chunk without choices: it finds none, and (with no tokenizer to fall
    # back on) has no output count and so no TPOT.
    assert vllm["output_lens"] == [None] * N_PROMPTS and math.isnan(vllm["mean_tpot_ms"])
    assert vllm["mean_itl_ms"] == pytest.approx(kvlab["mean_itl_ms"], rel=RTOL)


def test_without_usage_or_tokenizer_tokens_are_counted_as_chunks(server: ScriptedServer) -> None:
    script = Script(tokens_per_chunk=2, usage=False)
    (kvlab,) = paired(server, script, {})
    assert kvlab["output_tokens_counted_by"] == ["chunks"] and kvlab["output_lens"] == [script.chunks] * N_PROMPTS
    # A chunk is taken for one token, so TPOT is the chunk gap: twice the truth at two tokens a chunk.
    assert kvlab["mean_tpot_ms"] == pytest.approx(script.itl_ms, rel=RTOL)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return load_tokenizer(save_word_tokenizer(str(tmp_path_factory.mktemp("tokenizer"))))


def test_two_tokens_a_chunk_without_usage_are_counted_by_the_tokenizer(server: ScriptedServer, tokenizer) -> None:
    script = Script(tokens_per_chunk=2, usage=False)
    prompts = random_prompts(N_PROMPTS, 16, script.n_tokens, tokenizer=tokenizer)
    kvlab_args = {"options": RequestOptions(tokenizer=tokenizer), "prompts": prompts}
    kvlab, vllm = paired(server, script, kvlab_args, {"tokenizer": tokenizer})
    assert kvlab["output_tokens_counted_by"] == ["tokenizer"]
    assert_truth(kvlab, script)
    # With a tokenizer the prompts are exact: the server saw 16 token ids in each of kvlab's requests.
    assert [len(b["prompt"]) for b in server.bodies() if isinstance(b["prompt"], list)] == [16] * (N_PROMPTS + 1)
    assert vllm["output_lens"] == [script.n_tokens] * N_PROMPTS
    assert_agree(kvlab, vllm)


def test_the_command_line_counts_with_a_tokenizer_folder(server: ScriptedServer, tokenizer, capsys, tmp_path) -> None:
    folder = tokenizer.name_or_path
    for p in random_prompts(3, 40, 1, seed=7, tokenizer=tokenizer):  # as chat sends them: text of exactly 40 tokens
        assert len(tokenizer.encode(p.text, add_special_tokens=False)) == 40 and len(p.ids) == 40
    server.use(Script(ttft_s=0.0, gap_s=0.0, chunks=4, tokens_per_chunk=3, usage=False))
    argv = ("bench", "--endpoint", server.url, "--model", "scripted", "--num-prompts", "2", "--input-len", "24")
    code, out, _ = run_cli(capsys, *argv, "--tokenizer", folder, "--json", str(tmp_path / "out.json"))
    assert code == 0 and f"counted by {folder}'s count of the streamed text" in out and "exactly" in out
    assert "CHUNKS" not in out and json.loads((tmp_path / "out.json").read_text())["output_lens"] == [12, 12]
    code, _, err = run_cli(capsys, *argv, "--tokenizer", folder + "/missing")
    assert code == 2 and "tokenizer" in err
