"""``kvlab serve`` on loopback: streamed and whole responses carry each request's solo greedy tokens, through httpx
and the official ``openai`` client, 32 at once; errors are OpenAI's body naming the field; a client that leaves
mid-stream frees its blocks."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch
import uvicorn

from kvlab.cli import main
from kvlab.engine import Engine
from kvlab.model import Decoder
from kvlab.serve import Server, TextStream, decode_text, encode_text
from kvlab.tokenizer import VOCAB_SIZE, encode

from .helpers import run_cli, tiny_config

# A vocabulary past the tokenizer's, so outputs include ids written <|id:N|>.
CFG = tiny_config(vocab_size=VOCAB_SIZE + 26, max_seq_len=64)
NAME = "tiny"


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Server, str]]:
    engine = Engine(Decoder(CFG), n_blocks=48, block_size=4, max_batch=8)
    server = Server(engine, NAME)
    uv = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = uv.servers[0].sockets[0].getsockname()[1]
    yield server, f"http://127.0.0.1:{port}"
    uv.should_exit = True
    thread.join(timeout=10)


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
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=NAME, prompt="x", max_tokens=2, temperature=0.8)


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
    engine, decode_step = server.engine, server.engine.model.decode_step

    def slow_decode_step(*args, **kwargs):  # 40 steps take over a second: the client leaves long before the end
        time.sleep(0.03)
        return decode_step(*args, **kwargs)

    monkeypatch.setattr(engine.model, "decode_step", slow_decode_step)
    body = {"prompt": list(range(1, 11)), "max_tokens": 40, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        assert engine.free_blocks < engine.n_blocks  # the request holds its blocks while it streams
    wait_for_free_blocks(engine, timeout_s=1.0)


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
        ("completions", {"prompt": "x", "temperature": 0.5}, 400, "temperature"),
        ("completions", {"prompt": "x", "n": 2}, 400, "n"),
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


def test_a_full_waiting_queue_answers_429() -> None:
    # No lifespan over the ASGI transport, so the engine thread never starts: the first request waits for good.
    server = Server(Engine(Decoder(CFG), n_blocks=16, block_size=4), NAME, max_waiting=1)

    async def two() -> httpx.Response:
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvlab") as client:
            first = asyncio.create_task(client.post("/v1/completions", json={"prompt": "a"}))
            while server._waiting == 0:
                await asyncio.sleep(0.01)
            second = await client.post("/v1/completions", json={"prompt": "b"})
            first.cancel()
            return second

    response = asyncio.run(two())
    assert response.status_code == 429 and "waiting" in response.json()["error"]["message"]
    assert server._waiting == 0


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
                       (["--model", "kvlab-tiny-stdlib", "--window", "-3"], "--window")]:  # fmt: skip
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
