"""kvlab.endpoint against a scripted in-process server: vLLM's timing rules and field names, errors, arrivals."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvlab.endpoint import (
    Prompt,
    RequestOutcome,
    random_prompts,
    read_trace,
    run_benchmark,
    summarize_outcomes,
    sweep_contexts,
)

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


def scripted_server(chunks: list[str], gap_s: float, usage_tokens: int | None, status: int = 200):
    """An ASGI app answering every completion with ``chunks`` streamed ``gap_s`` apart (a first wait of ``gap_s``
    too), then a usage event when ``usage_tokens`` is set. It records each request body in ``app.bodies``."""

    async def app(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        app.bodies.append(json.loads(body))
        if status != 200:
            await send({"type": "http.response.start", "status": status, "headers": []})
            await send({"type": "http.response.body", "body": b'{"error": {"message": "full"}}'})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for text in chunks:
            await asyncio.sleep(gap_s)
            event = {"choices": [{"index": 0, "text": text}]}
            await send(
                {"type": "http.response.body", "body": f"data: {json.dumps(event)}\n\n".encode(), "more_body": True}
            )
        if usage_tokens is not None:
            event = {"choices": [], "usage": {"completion_tokens": usage_tokens}}
            await send(
                {"type": "http.response.body", "body": f"data: {json.dumps(event)}\n\n".encode(), "more_body": True}
            )
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    app.bodies = []
    return app


def bench(app, prompts, **kwargs) -> dict:
    return run_benchmark("http://test", "m", prompts, transport=httpx.ASGITransport(app=app), **kwargs)


def test_tokens_are_timed_on_arrival_as_vllm_does():
    app = scripted_server(["a", "b", "", "c", "d"], gap_s=0.02, usage_tokens=None)
    result = bench(app, random_prompts(2, 5, 4))
    assert set(result) >= VLLM_FIELDS and result["completed"] == 2 and result["failed"] == 0
    # The empty chunk carries no text: 4 tokens, 3 gaps each; TTFT one gap, E2EL about five.
    assert result["output_lens"] == [4, 4] and all(len(i) == 3 for i in result["itls"])
    assert result["mean_ttft_ms"] >= 20 and result["mean_e2el_ms"] >= 100
    assert result["mean_tpot_ms"] == pytest.approx((result["mean_e2el_ms"] - result["mean_ttft_ms"]) / 3, rel=0.2)
    body = app.bodies[0]
    assert body["stream"] is True and body["temperature"] == 0 and body["stream_options"] == {"include_usage": True}
    assert len(body["prompt"]) == 5 and body["max_tokens"] == 4


def test_usage_counts_tokens_where_a_chunk_holds_several():
    outcome = RequestOutcome(10, output_tokens=9, chunk_times_s=(0.1, 0.2, 0.5), latency_s=0.5)
    assert outcome.tpot_ms == pytest.approx((500 - 100) / 8) and outcome.itl_ms == pytest.approx([100, 300])
    result = bench(scripted_server(["ab", "cd"], gap_s=0.0, usage_tokens=4), random_prompts(1, 3, 4))
    assert result["output_lens"] == [4] and result["total_output_tokens"] == 4


def test_a_refused_request_is_counted_failed_with_its_status():
    result = bench(scripted_server(["a"], 0.0, None, status=429), random_prompts(3, 2, 2))
    assert result["completed"] == 0 and result["failed"] == 3 and all("HTTP 429" in e for e in result["errors"])


def test_concurrency_caps_requests_in_flight():
    app = scripted_server(["a", "b"], gap_s=0.05, usage_tokens=None)
    result = bench(app, random_prompts(4, 2, 2), max_concurrency=1)
    # One at a time: four requests of about 0.1 s each take about 0.4 s.
    assert result["duration"] >= 0.4 and result["completed"] == 4


def test_poisson_arrivals_spread_the_requests():
    app = scripted_server(["a"], gap_s=0.0, usage_tokens=None)
    result = bench(app, random_prompts(20, 2, 1), request_rate=50.0)
    assert result["completed"] == 20 and 0.15 < result["duration"] < 2.0  # 20 arrivals at 50/s: about 0.4 s


def test_summary_of_no_completed_request_has_no_latency_fields():
    out = summarize_outcomes([RequestOutcome(3, error="x")], 1.0)
    assert out["completed"] == 0 and "mean_ttft_ms" not in out


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: Prompt((), 3), "ids"),
        (lambda: Prompt((1, -2), 3), "ids"),
        (lambda: Prompt((1,), 0), "max_tokens"),
        (lambda: run_benchmark("http://x", "m", []), "prompts"),
        (lambda: run_benchmark("http://x", "m", random_prompts(1, 1, 1), max_concurrency=0), "max_concurrency"),
        (lambda: run_benchmark("http://x", "m", random_prompts(1, 1, 1), request_rate=0), "request_rate"),
    ],
)
def test_bad_input_names_the_field(call, field):
    with pytest.raises(ValueError, match=field):
        call()


def test_trace_files(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"input_len": 5, "output_len": 2}\n\n{"input_len": 3, "output_len": 1}\n')
    assert [(len(p.ids), p.max_tokens) for p in read_trace(str(path))] == [(5, 2), (3, 1)]
    path.write_text('{"input_len": 5}\n')
    with pytest.raises(ValueError, match="line 1"):
        read_trace(str(path))


def test_a_context_sweep_sends_prompts_of_each_length():
    app = scripted_server(["a", "b"], gap_s=0.0, usage_tokens=None)
    results = sweep_contexts("http://test", "m", [8, 32], 2, 2, transport=httpx.ASGITransport(app=app))
    assert [r["context"] for r in results] == [8, 32] and [r["input_lens"] for r in results] == [[8, 8], [32, 32]]
    assert sorted(len(b["prompt"]) for b in app.bodies) == [8, 8, 32, 32]


def test_it_runs_from_inside_an_event_loop_as_in_a_notebook():
    app = scripted_server(["a", "b"], gap_s=0.0, usage_tokens=None)

    async def cell() -> dict:  # Jupyter runs cells inside a running loop
        return bench(app, random_prompts(2, 3, 2))

    assert asyncio.run(cell())["completed"] == 2
