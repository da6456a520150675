"""kvlab.serving.client against scripted servers: what a token chunk is, the warm-up, prompts, probes, defaults, errors,
arrivals and the ``kvlab bench --endpoint`` command line. Most run in-process through ``httpx.ASGITransport``,
which hands over a response whole, so they check what is counted, not when it arrived: latencies against an exact
schedule on a real socket, and beside vLLM's client, are in test_endpoint_timing.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest

from kvlab.serving.client import (
    WORDS,
    EndpointError,
    Prompt,
    RequestOptions,
    RequestOutcome,
    ServerFacts,
    base_url,
    measure_prompt_tokens,
    random_prompts,
    read_trace,
    run_benchmark,
    summarize_outcomes,
    sweep_contexts,
)

from .helpers import run_cli
from .scripted_sse import Script, scripted_server

VLLM_FIELDS = {
    "duration",
    "completed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    *(f"{stat}_{m}_ms" for stat in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl", "e2el")),
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "errors",
}
FOUR_CHARS = ServerFacts(None, tokens_per_char=0.25)


def event(data: dict) -> dict:
    """One SSE event as an ASGI message."""
    return {"type": "http.response.body", "body": f"data: {json.dumps(data)}\n\n".encode(), "more_body": True}


def asgi_server(chunks: list[str], gap_s: float, usage_tokens: int | None, status=lambda body, n: 200, first_s=None):
    """An ASGI app answering every streamed request with ``chunks`` (completions text) ``gap_s`` apart (a first
    wait of ``first_s``, default ``gap_s``), then a usage event when ``usage_tokens`` is set; ``status(body, n)``
    picks the status of the ``n``-th request (1 = the first). Non-streamed requests get a usage of one token per
    character. It records each body in ``app.bodies``."""

    async def app(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body)
        app.bodies.append(request)
        code = status(request, len(app.bodies))
        if code != 200:
            await send({"type": "http.response.start", "status": code, "headers": []})
            await send({"type": "http.response.body", "body": b'{"error": {"message": "refused: stream_options"}}'})
            return
        if not request.get("stream"):
            out = json.dumps({"choices": [{"text": "x"}], "usage": {"prompt_tokens": len(request["prompt"]) + 1}})
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": out.encode()})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for k, text in enumerate(chunks):
            await asyncio.sleep(first_s if k == 0 and first_s is not None and len(app.bodies) == 1 else gap_s)
            event = {
                "choices": [{"index": 0, "text": text, "finish_reason": "length" if k == len(chunks) - 1 else None}]
            }
            await send(
                {"type": "http.response.body", "body": f"data: {json.dumps(event)}\n\n".encode(), "more_body": True}
            )
        if usage_tokens is not None:
            event = {"choices": [], "usage": {"completion_tokens": usage_tokens, "prompt_tokens": 7}}
            await send(
                {"type": "http.response.body", "body": f"data: {json.dumps(event)}\n\n".encode(), "more_body": True}
            )
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    app.bodies = []
    return app


def bench(app, prompts, **kwargs) -> dict:
    kwargs.setdefault("facts", FOUR_CHARS)
    return run_benchmark("http://test", "m", prompts, transport=httpx.ASGITransport(app=app), **kwargs)


def test_every_chunk_with_a_choice_counts_as_a_token_text_or_not():
    app = asgi_server(["a", "b", "", "c", "d"], gap_s=0.02, usage_tokens=None)
    result = bench(app, random_prompts(2, 5, 4))
    assert set(result) >= VLLM_FIELDS and result["completed"] == 2 and result["failed"] == 0
    # Five token chunks (one without text): four gaps each, counted one token a chunk as nothing else counts them.
    assert result["output_lens"] == [5, 5] and all(len(i) == 4 for i in result["itls"])
    assert result["output_tokens_counted_by"] == ["chunks"]
    assert result["mean_ttft_ms"] >= 20 and result["mean_e2el_ms"] >= 100
    assert result["mean_tpot_ms"] == pytest.approx((result["mean_e2el_ms"] - result["mean_ttft_ms"]) / 4, rel=1e-9)
    body = app.bodies[0]
    assert body["stream"] is True and body["temperature"] == 0 and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 4 and "ignore_eos" not in body
    assert isinstance(body["prompt"], str) and len(body["prompt"]) <= 5 * 4  # 5 tokens at 4 characters a token


def test_usage_counts_tokens_where_a_chunk_holds_several():
    outcome = RequestOutcome(10, output_tokens=9, chunk_times_s=(0.1, 0.2, 0.5))
    assert outcome.tpot_ms == pytest.approx((500 - 100) / 8) and outcome.itl_ms == pytest.approx([100, 300])
    assert outcome.e2el_ms == pytest.approx(500)  # the last token chunk, not the end of the stream
    result = bench(asgi_server(["ab", "cd"], gap_s=0.0, usage_tokens=4), random_prompts(1, 3, 4))
    assert result["output_lens"] == [4] and result["total_output_tokens"] == 4 and result["input_lens"] == [7]
    assert result["output_tokens_counted_by"] == ["usage"]


def test_a_stream_of_empty_text_with_usage_succeeds():
    result = bench(asgi_server(["", "", ""], gap_s=0.0, usage_tokens=3), random_prompts(2, 3, 3))
    assert result["completed"] == 2 and result["output_lens"] == [3, 3] and result["errors"] == ["", ""]


def chat_app(first: dict, usage_tokens: int):
    """A chat stream: ``first`` as the first delta, then the texts ``a`` and ``b``, then the usage."""

    async def app(scope, receive, send):
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for delta, finish in ((first, None), ({"content": "a"}, None), ({"content": "b"}, "length")):
            await send(event({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}))
        await send(event({"choices": [], "usage": {"completion_tokens": usage_tokens, "prompt_tokens": 3}}))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    return app


@pytest.mark.parametrize(("usage_tokens", "tokens_timed"), [(2, 2), (3, 3)])
def test_a_role_chunk_without_text_is_a_token_only_where_usage_counts_it(usage_tokens, tokens_timed):
    # vLLM's server opens a chat stream with {"role": "assistant", "content": ""}: no token (usage 2). kvlab serve
    # puts the role on its first token, whose text may be empty (a split character): a token (usage 3).
    opener = {"role": "assistant", "content": ""}
    result = bench(chat_app(opener, usage_tokens), random_prompts(1, 3, 3), options=RequestOptions("chat"))
    assert result["completed"] == 1 and len(result["itls"][0]) == tokens_timed - 1


def test_an_untimed_warm_up_request_goes_first():
    # The first request the server sees waits 0.5 s; the timed ones 0.01 s a chunk.
    app = asgi_server(["a", "b"], gap_s=0.01, usage_tokens=None, first_s=0.5)
    result = bench(app, random_prompts(3, 4, 2))
    assert len(app.bodies) == 4 and app.bodies[0] == app.bodies[1]  # the warm-up sends the first prompt
    assert result["completed"] == 3 and max(result["ttfts"]) < 0.4


def test_a_failed_warm_up_stops_the_run_and_a_refused_request_is_counted_failed():
    with pytest.raises(EndpointError, match="warm-up.*HTTP 429"):
        bench(asgi_server(["a"], 0.0, None, status=lambda body, n: 429), random_prompts(3, 2, 2))
    result = bench(asgi_server(["a"], 0.0, None, status=lambda body, n: 429 if n > 2 else 200), random_prompts(3, 2, 2))
    assert result["completed"] == 1 and result["failed"] == 2 and sum("HTTP 429" in e for e in result["errors"]) == 2


def test_a_server_that_refuses_stream_options_is_asked_without_it():
    app = asgi_server(["a", "b"], 0.0, None, status=lambda body, n: 400 if "stream_options" in body else 200)
    result = bench(app, random_prompts(2, 2, 2))
    assert result["completed"] == 2 and "stream_options" not in app.bodies[-1]


def test_concurrency_caps_requests_in_flight():
    app = asgi_server(["a", "b"], gap_s=0.05, usage_tokens=None)
    result = bench(app, random_prompts(4, 2, 2), max_concurrency=1)
    # One at a time: four requests of about 0.1 s each take about 0.4 s.
    assert result["duration"] >= 0.4 and result["completed"] == 4


def test_poisson_arrivals_spread_the_requests():
    app = asgi_server(["a"], gap_s=0.0, usage_tokens=None)
    result = bench(app, random_prompts(20, 2, 1), request_rate=50.0)
    assert result["completed"] == 20 and 0.15 < result["duration"] < 2.0  # 20 arrivals at 50/s: about 0.4 s


def test_summary_of_no_completed_request_has_no_latency_fields():
    out = summarize_outcomes([RequestOutcome(3, error="x")], 1.0)
    assert out["completed"] == 0 and "mean_ttft_ms" not in out


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: Prompt(3, ids=()), "ids"),
        (lambda: Prompt(3, ids=(1, -2)), "ids"),
        (lambda: Prompt(0, ids=(1,)), "max_tokens"),
        (lambda: Prompt(3), "input_len"),
        (lambda: Prompt(3, text=""), "text"),
        (lambda: RequestOptions("embeddings"), "endpoint_type"),
        (lambda: ServerFacts(100, 1.0, 0).default_input_len(100, exact=True), "output_len"),
        (lambda: run_benchmark("http://x", "m", []), "prompts"),
        (lambda: run_benchmark("http://x", "m", random_prompts(1, 1, 1), max_concurrency=0), "max_concurrency"),
        (lambda: run_benchmark("http://x", "m", random_prompts(1, 1, 1), request_rate=0), "request_rate"),
        (lambda: bench(asgi_server(["a"], 0, None), [Prompt(1, ids=(5,))], options=RequestOptions("chat")), "prompt"),
    ],
)
def test_bad_input_names_the_field(call, field):
    with pytest.raises(ValueError, match=field):
        call()


def test_prompts_are_ordinary_words_not_fixed_token_ids():
    app = asgi_server(["a"], 0.0, None)
    bench(app, random_prompts(3, 50, 1))
    texts = [b["prompt"] for b in app.bodies[1:]]
    assert len(set(texts)) == 3  # distinct prompts: no prefix cache serves one from another
    for text in texts:
        whole = text.split()[:-1]  # the last word may be cut to length
        assert whole and set(whole) <= set(WORDS) and len(text) <= 50 * 4


def test_the_probe_measures_tokens_per_character_and_reads_max_model_len():
    async def app(scope, receive, send):
        if scope["path"] == "/v1/models":
            out = {"data": [{"id": "other", "max_model_len": 9}, {"id": "m", "max_model_len": 512}]}
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": json.dumps(out).encode()})
            return
        await inner(scope, receive, send)

    inner = asgi_server(["a"], 0.0, None)  # usage.prompt_tokens: one per character plus one (a BOS)
    facts = measure_prompt_tokens("http://test/v1/", "m", transport=httpx.ASGITransport(app=app))
    assert facts == ServerFacts(512, 1.0, 1)
    assert [b["max_tokens"] for b in inner.bodies] == [1, 1] and not inner.bodies[0]["stream"]
    assert facts.default_input_len(64, exact=True) == 512 - 64 - 1
    assert facts.default_input_len(64, exact=False) == int(0.9 * (512 - 64 - 1))
    assert ServerFacts(None, None).default_input_len(64, exact=True) == 1024  # vLLM's
    assert ServerFacts(32768, 0.3).default_input_len(64, exact=True) == 1024


def test_base_urls_in_the_forms_clients_write():
    assert base_url("http://h:8000") == ("http://h:8000", None)
    assert base_url("http://h:8000/v1/") == ("http://h:8000", None)
    assert base_url("http://h:8000/v1/chat/completions") == ("http://h:8000", "chat")
    assert base_url("http://h:8000/v1/completions") == ("http://h:8000", "completions")


def test_trace_files(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"input_len": 5, "output_len": 2}\n\n{"input_len": 3, "output_len": 1}\n')
    assert [(p.input_len, p.max_tokens) for p in read_trace(str(path))] == [(5, 2), (3, 1)]
    path.write_text('{"input_len": 5}\n')
    with pytest.raises(ValueError, match="line 1"):
        read_trace(str(path))


def test_a_context_sweep_sends_prompts_of_each_length():
    app = asgi_server(["a", "b"], gap_s=0.0, usage_tokens=None)
    results = sweep_contexts(
        "http://test", "m", [8, 32], 2, 2, transport=httpx.ASGITransport(app=app), facts=FOUR_CHARS
    )
    assert [r["context"] for r in results] == [8, 32] and [r["input_lens"] for r in results] == [[8, 8], [32, 32]]
    # Four characters a token: 8 tokens are 32 characters of words, 32 tokens 128.
    assert sorted(len(b["prompt"]) for b in app.bodies) == [32] * 3 + [128] * 3


def test_it_runs_from_inside_an_event_loop_as_in_a_notebook():
    app = asgi_server(["a", "b"], gap_s=0.0, usage_tokens=None)

    async def cell() -> dict:  # Jupyter runs cells inside a running loop
        return bench(app, random_prompts(2, 3, 2))

    assert asyncio.run(cell())["completed"] == 2


def test_importing_the_client_loads_no_torch():
    code = "import sys, kvlab.serving.client; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.slow
def test_the_command_line_says_how_it_counted(capsys):
    with scripted_server() as server:
        server.use(Script(ttft_s=0.0, gap_s=0.0, chunks=4, tokens_per_chunk=2, usage=False, max_model_len=600))
        argv = ("bench", "--endpoint", server.url + "/v1", "--model", "scripted", "--num-prompts", "2")
        code, out, _ = run_cli(capsys, *argv, "--output-len", "8")
        assert code == 0 and "COUNTED AS CHUNKS" in out and "after one untimed warm-up request" in out
        # No --input-len: the default fits the 600-token context the server's /v1/models gives (a word a token on
        # this server, which the probe measured), where vLLM's 1024 would not.
        streamed = [b for b in server.bodies() if b.get("stream")]
        assert streamed and all(0.8 * (600 - 8) <= len(b["prompt"].split()) <= 600 - 8 for b in streamed)

        # A length the served context cannot hold is refused before any request, naming the option.
        code, _, err = run_cli(capsys, *argv, "--output-len", "8", "--contexts", "64,1k")
        assert code == 2 and "--contexts: 1024 with --output-len 8; allowed: at most 592" in err

        server.use(Script(ttft_s=0.0, gap_s=0.0, chunks=4, role_opener=True))
        code, out, _ = run_cli(capsys, *argv, "--backend", "openai-chat", "--ignore-eos", "--input-len", "16")
        assert code == 0 and "counted by the server's usage" in out and "/v1/chat/completions" in out
        streamed = [b for b in server.bodies() if b.get("stream")]
        assert len(streamed) == 3 and all(b["ignore_eos"] is True and "messages" in b for b in streamed)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--endpoint-type", "embeddings"), "--endpoint-type"),
        (("--backend", "tgi"), "--backend"),
        (("--backend", "openai-chat", "--endpoint-type", "completions"), "different endpoints"),
    ],
)
def test_the_command_line_refuses_unknown_endpoint_types(capsys, extra, message):
    code, _, err = run_cli(capsys, "bench", "--endpoint", "http://127.0.0.1:9/v1", "--model", "m", *extra)
    assert code == 2 and message in err
