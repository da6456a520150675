"""``kvlab serve`` on loopback: streamed and whole responses carry each request's solo greedy tokens, through httpx
and the official ``openai`` client, 32 at once; errors are OpenAI's body naming the field, for every status; a
client that leaves, streamed or not, queued or running, frees its blocks; 429 counts waiting requests only."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest
import torch
import uvicorn

from kvlab.cli import main
from kvlab.engine import Engine
from kvlab.model.decoder import Decoder
from kvlab.model.tokenizer import VOCAB_SIZE, encode
from kvlab.serving.server import Server, TextStream, decode_text, encode_text

from .helpers import run_cli, tiny_config

# Cancellation and admission are checked against deadlines of a second or less: alone, not beside other workers.
pytestmark = pytest.mark.serial

# A vocabulary past the tokenizer's, so outputs include ids written <|id:N|>.
CFG = tiny_config(vocab_size=VOCAB_SIZE + 26, max_seq_len=64)
NAME = "tiny"


@contextmanager
def serving(server: Server) -> Iterator[str]:
    """``server`` under uvicorn on an ephemeral loopback port, its lifespan run; yields its URL."""
    uv = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = uv.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Server, str]]:
    server = Server(Engine(Decoder(CFG), n_blocks=48, block_size=4, max_batch=8), NAME)
    with serving(server) as url:
        yield server, url


def slowed(monkeypatch: pytest.MonkeyPatch, engine: Engine, name: str, seconds: float) -> list:
    """Make the engine's model call ``name`` (decode_step, prefill) take ``seconds`` longer; returns the list of the
    token tensors each call received."""
    calls, original = [], getattr(engine.model, name)

    def slow(tokens, *args, **kwargs):
        calls.append(tokens)
        time.sleep(seconds)
        return original(tokens, *args, **kwargs)

    monkeypatch.setattr(engine.model, name, slow)
    return calls


def solo_text(server: Server, ids: list[int], n: int) -> str:
    return decode_text(server.engine.model.generate(ids, n).tolist())


def sse_texts(lines: Iterator[str], chat: bool = False) -> tuple[list[str], list[dict]]:
    """The streamed text pieces, and every event (the [DONE] terminator checked)."""
    events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    pieces = [c["choices"][0]["delta"]["content"] if chat else c["choices"][0]["text"] for c in chunks if c["choices"]]
    return pieces, chunks


def wait_for_free_blocks(engine: Engine, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.free_blocks != engine.n_blocks or engine.busy:
        assert time.monotonic() < deadline, f"{engine.n_blocks - engine.free_blocks} blocks still held"
        time.sleep(0.01)


# -- text ---------------------------------------------------------------------------------------------------------
def test_ids_past_the_tokenizer_round_trip_as_text() -> None:
    ids = [*encode("é<|endoftext|>"), VOCAB_SIZE + 3, 104, 105]
    assert decode_text(ids) == f"é<|endoftext|><|id:{VOCAB_SIZE + 3}|>hi"
    assert encode_text(decode_text(ids)) == ids
    stream = TextStream()  # the two bytes of é: nothing until the character is whole
    assert [stream.push(b) for b in "é".encode()] == ["", "é"]


# -- routes -------------------------------------------------------------------------------------------------------
def test_health_and_models(served: tuple[Server, str]) -> None:
    _, url = served
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    models = httpx.get(f"{url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [NAME] and models["data"][0]["max_model_len"] == CFG.max_seq_len
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        client.models.retrieve("gpt-4")


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/v1/nowhere", 404), ("GET", "/v1/completions", 405), ("POST", "/v1/models", 405),
     ("DELETE", "/health", 405)],
)  # fmt: skip
def test_unknown_routes_and_methods_get_openais_error_body(
    served: tuple[Server, str], method: str, path: str, status: int
) -> None:
    _, url = served
    response = httpx.request(method, f"{url}{path}")
    assert response.status_code == status
    assert response.json()["error"]["type"] == "invalid_request_error" and path in response.json()["error"]["message"]


def test_health_tells_a_dead_engine_thread() -> None:
    server = Server(Engine(Decoder(CFG), n_blocks=16, block_size=4), NAME)
    with serving(server) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        server.worker.stop()  # the engine thread ends, as an uncaught error would end it
        response = httpx.get(f"{url}/health")
        assert response.status_code == 503 and "engine" in response.json()["error"]["message"]
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert response.status_code == 503  # refused at once, not left waiting for a thread that is gone


def test_httpx_stream_carries_the_solo_tokens_and_usage(served: tuple[Server, str]) -> None:
    server, url = served
    body = {"model": NAME, "prompt": [5, 260, 7], "max_tokens": 6, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        pieces, chunks = sse_texts(response.iter_lines())
    assert "".join(pieces) == solo_text(server, [5, 260, 7], 6) and len(pieces) == 6
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}


def test_whole_responses_carry_the_solo_tokens(served: tuple[Server, str]) -> None:
    server, url = served
    out = httpx.post(f"{url}/v1/completions", json={"prompt": "def f(", "max_tokens": 5}).json()
    assert out["choices"][0]["text"] == solo_text(server, encode("def f("), 5)
    assert out["usage"] == {"prompt_tokens": 6, "completion_tokens": 5, "total_tokens": 11}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4, "temperature": 0}
    out = httpx.post(f"{url}/v1/chat/completions", json=chat).json()
    assert out["choices"][0]["message"]["content"] == solo_text(server, encode("user: hi\nassistant: "), 4)


def test_the_openai_client_streams_completions_and_chats(served: tuple[Server, str]) -> None:
    server, url = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(model=NAME, prompt="import os", max_tokens=5, stream=True)
    assert "".join(c.choices[0].text for c in stream) == solo_text(server, encode("import os"), 5)
    messages = [{"role": "system", "content": "be terse"}, {"role": "user", "content": "why?"}]
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text == solo_text(server, encode("system: be terse\nuser: why?\nassistant: "), 4)
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model=NAME, messages=messages, tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {}}}}])  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model=NAME, messages=messages, response_format={"type": "json_object"})


def test_32_concurrent_streams_each_get_their_solo_tokens(served: tuple[Server, str]) -> None:
    server, url = served
    gen = torch.Generator().manual_seed(0)
    requests = [
        (torch.randint(0, CFG.vocab_size, (int(torch.randint(1, 20, (1,), generator=gen)),), generator=gen).tolist(),
         int(torch.randint(1, 9, (1,), generator=gen)))
        for _ in range(32)
    ]  # fmt: skip

    async def one(client: httpx.AsyncClient, prompt: list[int], n: int) -> str:
        body = {"prompt": prompt, "max_tokens": n, "stream": True}
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            return "".join(sse_texts([line async for line in response.aiter_lines()])[0])

    async def all_at_once() -> list[str]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(one(client, p, n) for p, n in requests))

    texts = asyncio.run(all_at_once())
    assert texts == [solo_text(server, p, n) for p, n in requests]
    wait_for_free_blocks(server.engine)


def test_a_client_that_leaves_mid_stream_frees_its_blocks(
    served: tuple[Server, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, url = served
    engine = server.engine
    slowed(monkeypatch, engine, "decode_step", 0.03)  # 40 steps take over a second: the client leaves long before
    body = {"prompt": list(range(1, 11)), "max_tokens": 40, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        assert engine.free_blocks < engine.n_blocks  # the request holds its blocks while it streams
    wait_for_free_blocks(engine, timeout_s=1.0)


def test_whole_requests_whose_clients_time_out_free_their_blocks_within_a_second(
    served: tuple[Server, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, url = served
    engine = server.engine
    slowed(monkeypatch, engine, "decode_step", 0.05)  # 50 tokens: over 2.5 s, if nothing cancels them

    async def give_up(client: httpx.AsyncClient, i: int) -> None:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(f"{url}/v1/completions", json={"prompt": [i + 1] * 8, "max_tokens": 50}, timeout=0.5)

    async def four() -> None:
        async with httpx.AsyncClient() as client:
            await asyncio.gather(*(give_up(client, i) for i in range(4)))

    asyncio.run(four())
    assert engine.busy  # still generating when the clients left
    wait_for_free_blocks(engine, timeout_s=1.0)


@pytest.mark.slow
def test_queued_streams_whose_clients_left_are_never_prefilled(monkeypatch: pytest.MonkeyPatch) -> None:
    server = Server(Engine(Decoder(CFG), n_blocks=48, block_size=4, max_batch=1), NAME, max_waiting=3)
    engine = server.engine
    slowed(monkeypatch, engine, "decode_step", 0.05)
    prefills = slowed(monkeypatch, engine, "prefill", 0.0)
    with serving(server) as url:

        async def run() -> list[int]:
            async with httpx.AsyncClient(timeout=30) as client:
                body = {"prompt": [9] * 8, "max_tokens": 40, "stream": True}
                async with client.stream("POST", f"{url}/v1/completions", json=body):
                    queued = [{"prompt": [i + 20] * 8, "max_tokens": 4, "stream": True} for i in range(3)]
                    gone = [client.post(f"{url}/v1/completions", json=b, timeout=0.5) for b in queued]
                    for result in await asyncio.gather(*gone, return_exceptions=True):
                        assert isinstance(result, httpx.ReadTimeout)
                    deadline = time.monotonic() + 1.0
                    while server.waiting:  # they no longer count toward max_waiting ...
                        assert time.monotonic() < deadline, f"{server.waiting} requests still counted as waiting"
                        await asyncio.sleep(0.01)
                    # ... so three more fit where they were, while the first one still runs
                    again = [client.post(f"{url}/v1/completions", json=b | {"stream": False}) for b in queued]
                    return [r.status_code for r in await asyncio.gather(*again)]

        statuses = asyncio.run(run())
        wait_for_free_blocks(engine)
    assert statuses == [200, 200, 200]
    prefilled = [tuple(t[0].tolist()) for t in prefills]
    assert prefilled.count((9,) * 8) == 1
    assert all(prefilled.count((i + 20,) * 8) == 1 for i in range(3))  # once each: the second time, not the first


def test_429_counts_requests_not_yet_admitted_and_says_when_to_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    # One waiting place. The second request comes while the first, admitted, still prefills (it has no token yet):
    # it is not counted, so the second is taken. The third comes while the second waits for the engine: refused.
    server = Server(Engine(Decoder(CFG), n_blocks=48, block_size=4, max_batch=4), NAME, max_waiting=1)
    slowed(monkeypatch, server.engine, "prefill", 0.4)
    with serving(server) as url:

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:
                post = lambda i: client.post(f"{url}/v1/completions", json={"prompt": [i] * 4, "max_tokens": 4})  # noqa: E731
                first = asyncio.create_task(post(1))
                await asyncio.sleep(0.2)
                second = asyncio.create_task(post(2))
                await asyncio.sleep(0.05)
                third = await post(3)  # the engine is still in the first one's prefill
                return [await first, await second, third]

        responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200, 200, 429]
    assert responses[-1].headers["retry-after"] == "1" and "waiting" in responses[-1].json()["error"]["message"]
    assert server.waiting == 0


# -- errors -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("route", "body", "status", "param"),
    [
        ("completions", b"{not json", 400, None),
        ("completions", b"[1, 2]", 400, None),
        ("completions", {"prompt": 5}, 400, "prompt"),
        ("completions", {"prompt": [1, -2]}, 400, "prompt"),
        ("completions", {"prompt": [1, CFG.vocab_size]}, 400, "prompt"),
        ("completions", {"prompt": [1] * CFG.max_seq_len}, 400, "prompt"),
        ("completions", {"prompt": [1] * 60, "max_tokens": 5}, 400, "max_tokens"),
        ("completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("completions", {"prompt": "x", "max_tokens": "3"}, 400, "max_tokens"),
        ("completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
        ("completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
        ("completions", {"prompt": "x", "top_k": -2}, 400, "top_k"),
        ("completions", {"prompt": "x", "n": 0}, 400, "n"),
        ("completions", {"prompt": "x", "n": 2, "best_of": 3}, 400, "best_of"),
        ("completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ("completions", {"prompt": "x", "logprobs": 1, "echo": True}, 400, "echo"),
        ("completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
        ("completions", {"prompt": "x", "stop_token_ids": [CFG.vocab_size]}, 400, "stop_token_ids"),
        ("completions", {"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
        ("completions", {"prompt": "x", "suffix": "end"}, 400, "suffix"),
        ("completions", {"prompt": "x", "guided_json": {}}, 400, "guided_json"),
        ("completions", {"prompt": "\ud800"}, 400, "prompt"),
        ("completions", {"prompt": ["a", "\udfff"]}, 400, "prompt"),
        ("completions", {"prompt": "x", "stop": "\ud800"}, 400, "stop"),
        ("completions", b'{"prompt": "\\ud800"}', 400, "prompt"),
        ("completions", b"[" * 100_000, 400, None),
        ("completions", b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400, None),
        ("chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, 400, "messages"),
        ("chat/completions", {"messages": [{"role": "\ud800", "content": "x"}]}, 400, "messages"),
        ("chat/completions", {"messages": [{"role": "user", "content": None}]}, 400, "messages"),
        ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         400, "messages"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
         "top_logprobs"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type":
         "json_object"}}, 400, "response_format"),
        ("completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
        ("completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ("chat/completions", {"messages": "hi"}, 400, "messages"),
        ("chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}, 400,
         "max_completion_tokens"),
    ],
)  # fmt: skip
def test_bad_requests_get_an_openai_error_naming_the_field(
    served: tuple[Server, str], route: str, body: bytes | dict, status: int, param: str | None
) -> None:
    _, url = served
    content = body if isinstance(body, bytes) else json.dumps({"stream": True, **body}).encode()
    response = httpx.post(f"{url}/v1/{route}", content=content, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert param is None or param in error["message"]


def test_a_request_the_pool_cannot_hold_gets_the_engines_400() -> None:
    # 4 blocks of 4 hold 16 tokens; 10 prompt + 10 new need 19. The model's context (64) would allow it.
    server = Server(Engine(Decoder(CFG), n_blocks=4, block_size=4), NAME)

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvlab") as client:
            return await client.post("/v1/completions", json={"prompt": list(range(10)), "max_tokens": 10})

    server.worker.start()  # the ASGI transport runs no lifespan
    try:
        response = asyncio.run(post())
    finally:
        server.worker.stop()
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt" and "n_blocks x block_size = 4 x 4 = 16" in error["message"]


def test_serve_command_refuses_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, flag in [(["--model", "kvlab-tiny-stdlib", "--max-batch", "0"], "--max-batch"),
                       (["--model", "no-such-model"], "--model"),
                       (["--model", "kvlab-tiny-stdlib", "--port", "70000"], "--port"),
                       (["--model", "kvlab-tiny-stdlib", "--kv-dtype", "int3"], "--kv-dtype"),
                       (["--model", "kvlab-tiny-stdlib", "--sinks", "4"], "--sinks"),
                       (["--model", "kvlab-tiny-stdlib", "--window", "-3"], "--window"),
                       (["--model", "kvlab-tiny-stdlib", "--runtime", "fast"], "--runtime"),
                       (["--model", "kvlab-tiny-stdlib", "--runtime", "numba"], "'numba': numba reads")]:  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            main(["serve", *argv])
        assert exit_.value.code == 2 and flag in capsys.readouterr().err


def test_bench_endpoint_measures_kvlab_serve_as_vllm_does(
    served: tuple[Server, str], tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    server, url = served
    out = tmp_path / "sweep.json"
    argv = ["bench", "--endpoint", url, "--model", NAME, "--contexts", "8,24", "--num-prompts", "4"]
    argv += ["--output-len", "5", "--max-concurrency", "2", "--json", str(out)]
    code, printed, _ = run_cli(capsys, *argv)
    assert code == 0, printed
    runs = json.loads(out.read_text())
    assert [r["context"] for r in runs] == [8, 24] and all(r["completed"] == 4 for r in runs)
    for r in runs:
        assert r["output_lens"] == [5] * 4 and r["input_lens"] == [r["context"]] * 4
        assert {"median_tpot_ms", "p99_itl_ms", "mean_e2el_ms", "output_throughput"} <= set(r)
        assert r["median_ttft_ms"] < r["median_e2el_ms"]
    assert server.engine.free_blocks == server.engine.n_blocks
    # The prediction beside each context, for the model and bandwidth given (here any preset: the column's source).
    code, printed, _ = run_cli(capsys, *argv[:-2], "--bandwidth", "10", "--model-preset", "cpu-tiny")
    assert code == 0 and "predicted TPOT" in printed and "cpu-tiny at 10 GB/s" in printed
    code, _, err = run_cli(capsys, *argv[:-2], "--model-preset", "cpu-tiny")
    assert code == 2 and "--model-preset" in err
