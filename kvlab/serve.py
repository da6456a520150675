"""``kvlab serve``: the continuous-batching engine behind an OpenAI-compatible HTTP API (Starlette on uvicorn).

    kvlab serve --model kvlab-tiny-stdlib --port 8000
    curl -N localhost:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"model": "kvlab-tiny-stdlib", "prompt": "def main(", "max_tokens": 32, "stream": true}'

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streamed as server-sent events ending with
``data: [DONE]`` when ``stream`` is true), ``GET /v1/models``, ``GET /health``.

Fields honoured: ``model`` (optional; if given, the served model's name), ``prompt`` (text, or a list of token ids)
or ``messages`` (``[{"role", "content"}]``, rendered as ``"<role>: <content>\\n"`` lines then ``"assistant: "``),
``max_tokens`` (chat also ``max_completion_tokens``; default 16), ``stream``, ``stream_options.include_usage`` (a
last chunk with ``usage`` and no choices). The engine decodes greedily, so ``temperature`` must be 0, null or absent
and ``n`` 1; anything else is refused with a 400 naming the field. Other fields (``top_p``, ``stop``, ...) are
ignored. Every request generates exactly ``max_tokens`` tokens (``finish_reason: "length"``).

Text is the byte-level kvlab tokenizer (``kvlab.tokenizer``); a shipped checkpoint trained with a beginning-of-text
token gets it before every text prompt (and ``usage`` counts it), while a list of ids is served as given. A model whose
vocabulary reaches past the tokenizer's (a preset's or a Hugging Face checkpoint's) may emit ids the tokenizer has no
text for: each is written ``<|id:N|>``, and a text prompt reads ``<|id:N|>`` back as id ``N``, so output text fed back
as a prompt gives the same ids. A byte that starts a multi-byte UTF-8 character is held back until the character is
complete (a streamed chunk may carry no text); an invalid byte run becomes U+FFFD.

Errors are OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``: 400 for malformed JSON, a field of the
wrong type, ``max_tokens < 1``, or a prompt that with ``max_tokens`` exceeds the model's context or the engine's
pool; 404 for another ``model``; 429 when ``max_waiting`` requests already wait for their first token.

Threads: the engine runs in one background thread (torch work stays off the event loop). Requests reach it through a
queue; each token comes back with ``loop.call_soon_threadsafe`` into that request's own asyncio queue. A client that
disconnects mid-stream cancels its request, and the engine frees its blocks before its next step.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import queue
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvlab.engine import Engine, Request
from kvlab.model import Decoder
from kvlab.tokenizer import VOCAB_SIZE, decode, encode

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_UNKNOWN_ID = re.compile(r"<\|id:(\d+)\|>")


# -- text <-> ids -------------------------------------------------------------------------------------------------
def encode_text(text: str) -> list[int]:
    """``kvlab.tokenizer.encode``, with each ``<|id:N|>`` read as the id ``N`` (what ``TextStream`` writes)."""
    ids: list[int] = []
    last = 0
    for match in _UNKNOWN_ID.finditer(text):
        ids += encode(text[last : match.start()]) + [int(match.group(1))]
        last = match.end()
    return ids + encode(text[last:])


class TextStream:
    """Ids to text one at a time: bytes through an incremental UTF-8 decoder, so a character split over tokens is
    written whole once complete; special tokens as ``kvlab.tokenizer.decode`` writes them; others ``<|id:N|>``."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        if token < 256:
            return self._utf8.decode(bytes([token]))
        return self.flush() + (decode([token]) if token < VOCAB_SIZE else f"<|id:{token}|>")

    def flush(self) -> str:
        """Bytes still held back (an incomplete character, written as U+FFFD)."""
        return self._utf8.decode(b"", final=True)


def decode_text(ids: list[int]) -> str:
    stream = TextStream()
    return "".join(stream.push(t) for t in ids) + stream.flush()


# -- errors -------------------------------------------------------------------------------------------------------
class ApiError(Exception):
    """An OpenAI-style error: HTTP ``status`` and the body's ``message``, ``param`` (the field) and ``code``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


# -- the engine's thread ------------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Ticket:
    """One request on its way into the engine thread, and back: ``on_token(id)``, or ``on_error(ApiError)`` once."""

    request: Request
    param: str  # the field an engine's refusal names
    on_token: Callable[[int], None]
    on_error: Callable[[ApiError], None]


class EngineWorker:
    """Owns ``engine`` from one thread: adds, cancels and steps there, so nothing else touches the engine's state."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[tuple[str, _Ticket] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="kvlab-engine", daemon=True)

    def start(self) -> None:
        self.engine.start()
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(None)
        self._thread.join()

    def submit(self, ticket: _Ticket) -> None:
        self._inbox.put(("add", ticket))

    def cancel(self, ticket: _Ticket) -> None:
        self._inbox.put(("cancel", ticket))

    def _loop(self) -> None:
        handles: dict[_Ticket, Any] = {}
        while True:
            try:  # every message that came in, waiting for one only when there is nothing to step
                while True:
                    message = self._inbox.get(block=not self.engine.busy)
                    if message is None:
                        return
                    action, ticket = message
                    if action == "add":
                        try:
                            handles[ticket] = self.engine.add(ticket.request, ticket.on_token)
                        except ValueError as e:
                            ticket.on_error(ApiError(str(e), ticket.param))
                    elif ticket in handles:
                        self.engine.cancel(handles.pop(ticket))
            except queue.Empty:
                pass
            try:
                self.engine.step()
            except Exception as e:  # the model failed: every request in flight fails with it, and its blocks free
                for ticket in handles:
                    ticket.on_error(ApiError(f"the engine failed: {e}", status=500))
                handles.clear()
                self.engine.start()
            handles = {t: h for t, h in handles.items() if not h.done}


# -- requests -----------------------------------------------------------------------------------------------------
def _field(body: dict, name: str, kinds: tuple[type, ...], allowed: str, default: Any = None) -> Any:
    value = body.get(name, default)
    if value is not None and (isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds)):
        raise ApiError(f"{name}: {value!r}; allowed: {allowed}", name)
    return default if value is None else value


@dataclass(frozen=True)
class _Call:
    """A validated request: prompt ids, tokens to generate, streaming options."""

    prompt_ids: list[int]
    prompt_field: str  # what an error about the prompt names: prompt or messages
    max_tokens: int
    stream: bool
    include_usage: bool


class Server:
    """The HTTP app over one engine: ``app`` is the Starlette application (its lifespan starts the engine thread)."""

    def __init__(self, engine: Engine, model_name: str, bos: int | None = None, max_waiting: int = 64) -> None:
        self.engine, self.model_name, self.bos, self.max_waiting = engine, model_name, bos, max_waiting
        self.worker = EngineWorker(engine)
        self.created = int(time.time())
        self._waiting = 0  # requests accepted that have no token yet (the event loop's count; no lock needed)
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
            ],
            exception_handlers={ApiError: lambda request, e: e.response()},
            lifespan=self._lifespan,
        )

    @asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.worker.start()
        yield
        self.worker.stop()

    async def _health(self, request: HTTPRequest) -> Response:
        return JSONResponse({"status": "ok"})

    async def _models(self, request: HTTPRequest) -> Response:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "kvlab",
            "max_model_len": self.engine.model.cfg.max_seq_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    # -- parsing ------------------------------------------------------------------------------------------------
    async def _body(self, request: HTTPRequest) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(f"body: not valid JSON ({e}); allowed: a JSON object") from None
        if not isinstance(body, dict):
            raise ApiError(f"body: {type(body).__name__}; allowed: a JSON object")
        model = _field(body, "model", (str,), "a string")
        if model is not None and model != self.model_name:
            raise ApiError(f"model: {model!r}; allowed: {self.model_name!r}", "model", 404, "model_not_found")
        temperature = _field(body, "temperature", (int, float), "0 (the engine decodes greedily)")
        if temperature not in (None, 0):
            raise ApiError(f"temperature: {temperature!r}; allowed: 0 (the engine decodes greedily)", "temperature")
        if _field(body, "n", (int,), "1", 1) != 1:
            raise ApiError(f"n: {body['n']!r}; allowed: 1", "n")
        return body

    def _call(self, body: dict, prompt_ids: list[int], prompt_field: str, max_tokens_field: str) -> _Call:
        max_tokens = _field(body, max_tokens_field, (int,), "an integer >= 1", DEFAULT_MAX_TOKENS)
        if max_tokens < 1:
            raise ApiError(f"{max_tokens_field}: {max_tokens}; allowed: an integer >= 1", max_tokens_field)
        context = self.engine.model.cfg.max_seq_len
        if not prompt_ids:
            raise ApiError(f"{prompt_field}: empty; allowed: at least one token", prompt_field)
        if len(prompt_ids) >= context:
            raise ApiError(
                f"{prompt_field}: {len(prompt_ids)} tokens; allowed: fewer than the model's context, {context}",
                prompt_field,
            )
        if len(prompt_ids) + max_tokens > context:
            raise ApiError(
                f"{max_tokens_field}: {max_tokens} after a {len(prompt_ids)}-token prompt; allowed: at most "
                f"{context - len(prompt_ids)} (the model's context is {context})",
                max_tokens_field,
            )
        vocab = self.engine.model.cfg.vocab_size
        if max(prompt_ids) >= vocab:
            raise ApiError(f"{prompt_field}: id {max(prompt_ids)}; allowed: ids below vocab_size={vocab}", prompt_field)
        stream = _field(body, "stream", (bool,), "true or false", False)
        options = _field(body, "stream_options", (dict,), "an object", {})
        include_usage = _field(options, "include_usage", (bool,), "true or false", False)
        return _Call(prompt_ids, prompt_field, max_tokens, stream, include_usage)

    def _with_bos(self, ids: list[int]) -> list[int]:
        return ids if self.bos is None else [self.bos, *ids]

    # -- generation ---------------------------------------------------------------------------------------------
    async def _tokens(self, call: _Call) -> AsyncIterator[int]:
        """The request's tokens as the engine samples them. The first is awaited before a response starts, so a
        request the engine refuses still gets its 400."""
        if self._waiting >= self.max_waiting:
            raise ApiError(f"the server already has {self._waiting} requests waiting; retry later", None, 429)
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue[int | ApiError] = asyncio.Queue()
        put = lambda item: loop.call_soon_threadsafe(tokens.put_nowait, item)  # noqa: E731
        ticket = _Ticket(Request(call.prompt_ids, call.max_tokens), call.prompt_field, put, put)
        self._waiting += 1
        first = True
        try:
            self.worker.submit(ticket)
            for _ in range(call.max_tokens):
                item = await tokens.get()
                if first:
                    self._waiting, first = self._waiting - 1, False
                if isinstance(item, ApiError):
                    raise item
                yield item
        finally:  # a client gone mid-stream lands here too (cancelled): free its blocks
            if first:
                self._waiting -= 1
            self.worker.cancel(ticket)

    def _usage(self, call: _Call, n: int) -> dict:
        prompt = len(call.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}

    async def _respond(self, call: _Call, chat: bool) -> Response:
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": rid, "created": int(time.time()), "model": self.model_name}
        tokens = self._tokens(call)
        first = await anext(tokens)  # raises the request's ApiError before any response starts
        if not call.stream:
            ids = [first] + [t async for t in tokens]
            text = decode_text(ids)
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                if chat
                else {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
            )
            kind = "chat.completion" if chat else "text_completion"
            return JSONResponse({**head, "object": kind, "choices": [choice], "usage": self._usage(call, len(ids))})

        async def events() -> AsyncIterator[str]:
            kind = "chat.completion.chunk" if chat else "text_completion"
            text = TextStream()
            n = 0

            async def all_tokens() -> AsyncIterator[int]:
                yield first
                async for t in tokens:
                    yield t

            try:
                async for token in all_tokens():
                    n += 1
                    last = n == call.max_tokens
                    piece = text.push(token) + (text.flush() if last else "")
                    finish = "length" if last else None
                    choice = (
                        {"index": 0, "delta": {"role": "assistant", "content": piece} if n == 1 else {"content": piece}}
                        if chat
                        else {"index": 0, "text": piece, "logprobs": None}
                    )
                    chunk = {**head, "object": kind, "choices": [choice | {"finish_reason": finish}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                if call.include_usage:
                    usage = {**head, "object": kind, "choices": [], "usage": self._usage(call, n)}
                    yield f"data: {json.dumps(usage)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                await tokens.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _completions(self, request: HTTPRequest) -> Response:
        body = await self._body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            ids = self._with_bos(encode_text(prompt))
        elif isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
        ):
            ids = list(prompt)
        else:
            raise ApiError(f"prompt: {prompt!r:.80}; allowed: a string or a list of token ids >= 0", "prompt")
        return await self._respond(self._call(body, ids, "prompt", "max_tokens"), chat=False)

    async def _chat(self, request: HTTPRequest) -> Response:
        body = await self._body(request)
        messages = body.get("messages")
        ok = isinstance(messages, list) and messages
        if not ok or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise ApiError(
                f"messages: {messages!r:.80}; allowed: a non-empty list of {{'role': str, 'content': str}}", "messages"
            )
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        return await self._respond(self._call(body, self._with_bos(encode_text(text)), "messages", field), chat=True)


# -- the model ----------------------------------------------------------------------------------------------------
def load_model(spec: str, device: str | None = None) -> tuple[Decoder, str, int | None]:
    """``spec``: a shipped checkpoint, a local Hugging Face folder, or a runnable preset (random weights, seed 0).
    Returns the model, the name it is served as, and the token to put before every text prompt (or None)."""
    from kvlab.presets import get_model
    from kvlab.pretrained import bos_token, list_pretrained, load_pretrained

    if spec in list_pretrained():
        return load_pretrained(spec, device), spec, bos_token(spec)
    if Path(spec).is_dir():
        from kvlab.hf import from_hf

        return from_hf(spec, device), Path(spec).resolve().name, None
    cfg = get_model(spec, "model")
    return Decoder(cfg, device=device), spec, None


def run_server(server: Server, host: str, port: int) -> None:
    """Serve ``server.app`` with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(server.app, host=host, port=port, log_level="info")
