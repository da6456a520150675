"""A scripted OpenAI-compatible SSE server for the client tests: every chunk leaves on an exact, absolute schedule,
so the latencies a client should measure are known in advance (``Script``'s truth properties).

It runs in a process of its own on a loopback socket, as a remote server would (in the tests' process its timers
would wait on the client's work), and records each body. ``PUT /script`` sets what it sends, ``GET /bodies`` reads
what it received."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass(frozen=True)
class Script:
    """What every streamed request gets: ``chunks`` events carrying ``tokens_per_chunk`` tokens each (the word
    ``the``, or empty text when ``text`` is False), the first ``ttft_s`` after the request arrives and then one every
    ``gap_s``; then, ``tail_s`` later, the usage event (when ``usage`` and the client asked for it) and ``[DONE]``.
    ``role_opener``: chat streams open with a role-only chunk at once, as vLLM's server does. ``usage_on_last_chunk``:
    the usage rides on the last token chunk instead of an event of its own."""

    ttft_s: float = 0.06
    gap_s: float = 0.04
    chunks: int = 20
    tokens_per_chunk: int = 1
    text: bool = True
    usage: bool = True
    tail_s: float = 0.0
    role_opener: bool = False
    usage_on_last_chunk: bool = False  # as llama.cpp's llama-server sends it on completions
    max_model_len: int | None = None

    @property
    def n_tokens(self) -> int:
        return self.chunks * self.tokens_per_chunk

    @property
    def ttft_ms(self) -> float:
        return self.ttft_s * 1e3

    @property
    def itl_ms(self) -> float:
        return self.gap_s * 1e3

    @property
    def e2el_ms(self) -> float:
        return (self.ttft_s + (self.chunks - 1) * self.gap_s) * 1e3

    @property
    def tpot_ms(self) -> float:
        return (self.e2el_ms - self.ttft_ms) / (self.n_tokens - 1)


def _sse(event: dict) -> str:
    return f"data: {json.dumps(event)}\n\n"


class _App:
    def __init__(self) -> None:
        self.script = Script()
        self.bodies: list[dict] = []
        routes = [
            Route("/v1/completions", self._generate, methods=["POST"]),
            Route("/v1/chat/completions", self._generate, methods=["POST"]),
            Route("/v1/models", self._models),
            Route("/script", self._set_script, methods=["PUT"]),
            Route("/bodies", lambda request: JSONResponse(self.bodies)),
        ]
        self.app = Starlette(routes=routes)

    async def _set_script(self, request: Request) -> Response:
        self.script, self.bodies = Script(**await request.json()), []
        return JSONResponse({})

    async def _models(self, request: Request) -> Response:
        model = {"id": "scripted", "object": "model"}
        if self.script.max_model_len:
            model["max_model_len"] = self.script.max_model_len
        return JSONResponse({"object": "list", "data": [model]})

    async def _generate(self, request: Request) -> Response:
        start = time.perf_counter()
        script = self.script
        body = await request.json()
        self.bodies.append(body)
        chat = request.url.path.endswith("/chat/completions")
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": script.n_tokens}
        if not body.get("stream"):
            return JSONResponse({"choices": [{"index": 0, "text": "the", "finish_reason": "length"}], "usage": usage})
        piece = " the" * script.tokens_per_chunk if script.text else ""
        wants_usage = script.usage and (body.get("stream_options") or {}).get("include_usage")

        def choice(k: int) -> dict:
            finish = "length" if k == script.chunks - 1 else None
            if chat:
                return {"index": 0, "delta": {"content": piece}, "finish_reason": finish}
            return {"index": 0, "text": piece, "finish_reason": finish}

        async def at(due_s: float) -> None:  # an absolute schedule: no drift however long each send takes
            await asyncio.sleep(max(0.0, start + due_s - time.perf_counter()))

        async def events() -> AsyncIterator[str]:
            if chat and script.role_opener:
                yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for k in range(script.chunks):
                await at(script.ttft_s + k * script.gap_s)
                last = k == script.chunks - 1
                yield _sse({"choices": [choice(k)]} | ({"usage": usage} if last and script.usage_on_last_chunk else {}))
            await at(script.ttft_s + (script.chunks - 1) * script.gap_s + script.tail_s)
            if wants_usage and not script.usage_on_last_chunk:
                yield _sse({"choices": [], "usage": usage})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


class ScriptedServer:
    """A handle on the server process: ``url`` (its root), ``use(script)``, ``bodies()``."""

    def __init__(self, url: str) -> None:
        self.url = url

    def use(self, script: Script) -> None:
        """Send ``script`` from the next request on, and forget the bodies received so far."""
        httpx.put(self.url + "/script", json=asdict(script)).raise_for_status()

    def bodies(self) -> list[dict]:
        return httpx.get(self.url + "/bodies").json()


@contextmanager
def scripted_server() -> Iterator[ScriptedServer]:
    """A ``ScriptedServer`` process listening on 127.0.0.1 (a free port) for the block's duration."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, "-m", "tests.scripted_sse", str(port)], cwd=root, env=env)
    server = ScriptedServer(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 60
    while True:
        try:
            server.bodies()
            break
        except httpx.HTTPError:
            assert process.poll() is None and time.monotonic() < deadline, "the scripted server did not start"
            time.sleep(0.05)
    try:
        yield server
    finally:
        process.terminate()
        process.wait(timeout=30)


def save_word_tokenizer(folder: str) -> str:
    """A Hugging Face tokenizer saved to ``folder`` (returned): one token per word of ``kvlab.serving.client.WORDS``,
    split on whitespace, as ``--tokenizer`` would load a real one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from kvlab.serving.client import WORDS

    vocab = {"[UNK]": 0} | {w: i + 1 for i, w in enumerate(sorted(set(WORDS)))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]").save_pretrained(folder)
    return folder


if __name__ == "__main__":
    uvicorn.run(_App().app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
