"""``kvlab serve``: the continuous-batching engine behind an OpenAI-compatible HTTP API (Starlette on uvicorn).

    kvlab serve --model kvlab-tiny-stdlib --port 8000
    curl -N localhost:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"model": "kvlab-tiny-stdlib", "prompt": "def main(", "max_tokens": 32, "stream": true}'

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streamed as server-sent events ending with
``data: [DONE]`` when ``stream`` is true), ``GET /v1/models`` (each entry with ``max_model_len``, as vLLM gives it),
``GET /v1/models/{id}``, ``GET /health`` (503 once the engine thread has died).

Fields honoured:

- ``model`` (optional; if given, the served model's name); ``prompt`` (text, a list of token ids, or a batch: a list
  of texts or of id lists, one choice per prompt and ``n``) or ``messages`` (``role`` and ``content``, a string, a
  list of ``{"type": "text", "text"}`` parts joined by newlines, or null for an assistant; rendered as
  ``"<role>: <content>\\n"`` lines then ``"assistant: "``);
- ``max_tokens`` (chat also ``max_completion_tokens``; default 16 for completions and, for chat, up to the
  context), ``stream``, ``stream_options.include_usage`` (a last chunk with ``usage`` and no choices);
- sampling: ``temperature`` (0, null or absent: greedy, the tokens ``model.generate`` gives), ``top_p``, ``top_k``
  (vLLM's; -1 or 0: off), ``seed`` (choice ``i`` of ``n`` draws with ``seed + i``; the same seed gives the same
  tokens whatever else the engine batches), ``n``, ``best_of`` (only equal to ``n``);
- stopping: ``stop`` (strings: the text ends before the first one, streamed too: text that could begin one is held
  back), ``stop_token_ids`` (vLLM's), the model's end-of-text token (a shipped checkpoint's ``<|endoftext|>``)
  unless ``ignore_eos``; ``finish_reason`` is ``"stop"`` for these, ``"length"`` at ``max_tokens``;
- ``logprobs``: completions ``logprobs: k`` (OpenAI's ``tokens`` / ``token_logprobs`` / ``top_logprobs`` /
  ``text_offset``), chat ``logprobs: true`` with ``top_logprobs: k`` (``content: [{token, logprob, bytes,
  top_logprobs}]``); ``k`` at most 20; the model's own log-probabilities, before temperature and truncation;
- ``echo`` (completions: the prompt's text before the output; not with ``logprobs``); ``user``.

Any other field is refused with a 400 naming it, unless it holds the value that changes nothing (``tools: []``,
``response_format: {"type": "text"}``, penalties of 0, ``repetition_penalty: 1``, ``logprobs: null``, ...): a
client never gets a 200 for something it asked for and did not get.

Text is the byte-level kvlab tokenizer (``kvlab.model``'s); a shipped checkpoint trained with a beginning-of-text
token gets it before every text prompt (and ``usage`` counts it), while a list of ids is served as given. A model whose
vocabulary reaches past the tokenizer's (a preset's or a Hugging Face checkpoint's) may emit ids the tokenizer has no
text for: each is written ``<|id:N|>``, and a text prompt reads ``<|id:N|>`` back as id ``N``, so output text fed back
as a prompt gives the same ids. A byte that starts a multi-byte UTF-8 character is held back until the character is
complete (a streamed chunk may carry no text); an invalid byte run becomes U+FFFD.

Errors are OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``, for every status: 400 for malformed or
too deeply nested JSON, a field of the wrong type or value (a lone UTF-16 surrogate in a text among them), or a
prompt that with ``max_tokens`` exceeds the model's context or the engine's pool; 404 for another ``model`` or an
unknown route, 405 for a wrong method; 429 (with ``Retry-After``) when ``max_waiting`` requests already wait for the
engine to admit them; 503 when the engine thread is dead.

Threads: the engine runs in one background thread (torch work stays off the event loop). Requests reach it through a
queue; each token comes back with ``loop.call_soon_threadsafe`` into that request's own asyncio queue. A client that
goes away cancels its requests wherever they are, as vLLM does: waiting (never prefilled, no longer counted for 429),
running (blocks freed before the engine's next step), streamed or not.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import math
import queue
import re
import reprlib
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from kvlab.engine import Engine, OnToken, Request
from kvlab.model.decoder import Decoder
from kvlab.model.sampling import SamplingParams, TokenLogprobs
from kvlab.model.tokenizer import EOT, VOCAB_SIZE, decode, encode

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs (vLLM's default max_logprobs too)
MAX_N = 128  # OpenAI's limit for n
MAX_DEPTH = 32  # JSON nesting a request may have; no field needs more than 4
RETRY_AFTER_S = 1
_UNKNOWN_ID = re.compile(r"<\|id:(\d+)\|>")
_SHOW = reprlib.Repr()  # a field's value in an error message, cut short (a 10 MB prompt is not repeated back)
_SHOW.maxstring, _SHOW.maxlist, _SHOW.maxdict, _SHOW.maxother = 80, 8, 8, 80


# -- text <-> ids -------------------------------------------------------------------------------------------------
def encode_text(text: str) -> list[int]:
    """``kvlab.model.tokenizer.encode``, with each ``<|id:N|>`` read as the id ``N`` (what ``TextStream`` writes).
    Raises ``UnicodeEncodeError`` for a lone surrogate (text that has no UTF-8 bytes)."""
    ids: list[int] = []
    last = 0
    for match in _UNKNOWN_ID.finditer(text):
        ids += encode(text[last : match.start()]) + [int(match.group(1))]
        last = match.end()
    return ids + encode(text[last:])


def token_text(token: int) -> str:
    """One token's own text, as a logprobs entry names it: a byte that is not ASCII alone is ``bytes:\\xNN``
    (OpenAI's form for a piece of a character)."""
    if token < 128:
        return chr(token)
    if token < 256:
        return f"bytes:\\x{token:02x}"
    return decode([token]) if token < VOCAB_SIZE else f"<|id:{token}|>"


def token_bytes(token: int) -> list[int]:
    return [token] if token < 256 else list(token_text(token).encode())


class TextStream:
    """Ids to text one at a time: bytes through an incremental UTF-8 decoder, so a character split over tokens is
    written whole once complete; special tokens as ``kvlab.model.tokenizer.decode`` writes them; others ``<|id:N|>``."""

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


class StopText:
    """Text in pieces, cut before the first of ``stops``: ``push`` returns what may be written now and whether a
    stop string was found. A tail that could be the start of a stop string is held back until the next piece
    settles it, so a streamed client never sees text that a stop string then takes back."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops, self._held = stops, ""

    def push(self, piece: str) -> tuple[str, bool]:
        text = self._held + piece
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self._held = ""
            return text[: min(found)], True
        # The longest tail that begins some stop string: no stop can start before it (it would have been found).
        keep = max((k for s in self.stops for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k])),
                   default=0)  # fmt: skip
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


# -- errors -------------------------------------------------------------------------------------------------------
def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON response escaped to ASCII: a lone surrogate a client sent and an error message repeats stays valid."""
    return Response(json.dumps(body), status, headers, media_type="application/json")


class ApiError(Exception):
    """An OpenAI-style error: HTTP ``status`` and the body's ``message``, ``param`` (the field) and ``code``."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.headers = message, param, status, code, headers

    def response(self) -> Response:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return _json(body, self.status, self.headers)


def _refuse(name: str, value: Any, allowed: str) -> ApiError:
    return ApiError(f"{name}: {_SHOW.repr(value)}; allowed: {allowed}", name.split("[")[0].split(".")[0])


# -- the engine's thread ------------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Ticket:
    """One request on its way into the engine thread, and back: ``on_token(id, logprobs)``, or ``on_error(ApiError)``
    once. ``handle`` is the engine's, once the engine thread has added it."""

    request: Request
    param: str  # the field an engine's refusal names
    on_token: OnToken
    on_error: Callable[[ApiError], None]
    handle: Any = None

    @property
    def waiting(self) -> bool:
        """Not yet admitted by the engine (in the inbox or the engine's queue)."""
        return self.handle is None or not self.handle.admitted


class EngineWorker:
    """Owns ``engine`` from one thread: adds, cancels and steps there, so nothing else touches the engine's state."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[tuple[str, _Ticket] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="kvlab-engine", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self.engine.start()
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(None)
        if self.alive:
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
                            handles[ticket] = ticket.handle = self.engine.add(ticket.request, ticket.on_token)
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
        raise _refuse(name, value, allowed)
    return default if value is None else value


def _number(body: dict, name: str, low: float, high: float, allowed: str) -> float | None:
    value = _field(body, name, (int, float), allowed)
    if value is not None and not low <= value <= high:  # NaN fails both comparisons
        raise _refuse(name, value, allowed)
    return value


def _text(value: str, name: str) -> str:
    """``value`` if it has UTF-8 bytes; a lone surrogate (``"\\ud800"``, from a string cut inside a UTF-16 pair) is
    refused naming the field."""
    try:
        value.encode()
    except UnicodeEncodeError as e:
        raise ApiError(
            f"{name}: a lone UTF-16 surrogate at character {e.start}; allowed: text whose surrogates come in pairs",
            name.split("[")[0],
        ) from None
    return value


def _depth(value: Any) -> int:
    """How deeply ``value`` nests lists and objects (iteratively: a deep value must not exhaust the stack)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, depth)
            if depth <= MAX_DEPTH:
                todo += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return deepest


# Fields a client may send at the value that changes nothing (OpenAI's default or vLLM's), and what that value is.
_NEUTRAL: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "presence_penalty": ("0", lambda v: v in (None, 0)),
    "frequency_penalty": ("0", lambda v: v in (None, 0)),
    "repetition_penalty": ("1", lambda v: v in (None, 1)),
    "min_tokens": ("0", lambda v: v in (None, 0)),
    "logit_bias": ("{} or null", lambda v: v in (None, {})),
    "suffix": ('"" or null', lambda v: v in (None, "")),
    "tools": ("[] or null (no tool calling)", lambda v: v in (None, [])),
    "functions": ("[] or null (no function calling)", lambda v: v in (None, [])),
    "tool_choice": ('"none" or null', lambda v: v in (None, "none")),
    "function_call": ('"none" or null', lambda v: v in (None, "none")),
    "parallel_tool_calls": ("null", lambda v: v is None),
    "response_format": ('{"type": "text"} or null', lambda v: v in (None, {"type": "text"})),
}
_NO_EFFECT = {"user", "metadata", "store"}  # recorded by OpenAI, never change the output
_COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop",
           "stop_token_ids", "ignore_eos", "logprobs", "best_of"}  # fmt: skip
_FIELDS = {"completions": _COMMON | {"prompt", "echo"}, "chat": _COMMON | {"messages", "max_completion_tokens",
                                                                          "top_logprobs"}}  # fmt: skip


@dataclass(frozen=True)
class _Prompt:
    ids: list[int]
    text: str  # what ``echo`` writes back


@dataclass(frozen=True)
class _Call:
    """A validated request: its prompts, and per choice how to generate and stop."""

    prompts: list[_Prompt]
    prompt_field: str  # what an error about the prompt names: prompt or messages
    max_tokens: list[int]  # per prompt
    n: int
    sampling: SamplingParams
    stops: tuple[str, ...]
    logprobs: int | None
    echo: bool
    stream: bool
    include_usage: bool

    def jobs(self) -> list[tuple[int, _Prompt, int, SamplingParams]]:
        """``(index, prompt, max_tokens, sampling)`` per choice, numbered prompt-major as OpenAI numbers them."""
        seed = self.sampling.seed
        return [
            (p * self.n + i, prompt, self.max_tokens[p],
             self.sampling if seed is None else SamplingParams(**{**vars(self.sampling), "seed": seed + i}))
            for p, prompt in enumerate(self.prompts) for i in range(self.n)
        ]  # fmt: skip


@dataclass(frozen=True)
class _Piece:
    """What one generated token adds to a choice: text that may be written now, the token's logprobs (None when not
    asked for, or for a stop token), and the finish reason on the choice's last piece."""

    text: str
    logprobs: TokenLogprobs | None
    finish: str | None


async def _until_gone(request: HTTPRequest) -> None:
    """Returns when the client has disconnected (the request's body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Server:
    """The HTTP app over one engine: ``app`` is the Starlette application (its lifespan starts the engine thread).

    ``eos``: the token that ends a text (a request stops at it unless ``ignore_eos``); None: the model has none.
    """

    def __init__(
        self, engine: Engine, model_name: str, bos: int | None = None, max_waiting: int = 64, eos: int | None = None
    ) -> None:
        self.engine, self.model_name, self.bos, self.max_waiting, self.eos = engine, model_name, bos, max_waiting, eos
        self.worker = EngineWorker(engine)
        self.created = int(time.time())
        self._tickets: set[_Ticket] = set()  # requests in the engine (the event loop's set; no lock needed)
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/models/{model:path}", self._model, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
            ],
            exception_handlers={
                ApiError: lambda request, e: e.response(),
                HTTPException: self._http_error,
                Exception: lambda request, e: ApiError(f"internal error: {type(e).__name__}", status=500).response(),
            },
            lifespan=self._lifespan,
        )

    @property
    def waiting(self) -> int:
        """Requests the engine has not admitted yet: what ``max_waiting`` limits."""
        return sum(t.waiting for t in self._tickets)

    @asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.worker.start()
        yield
        self.worker.stop()

    @staticmethod
    def _http_error(request: HTTPRequest, e: HTTPException) -> Response:
        routes = "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{id}, GET /health"
        what = "route" if e.status_code == 404 else "method"
        message = f"{what}: {request.method} {request.url.path} ({e.detail}); allowed: {routes}"
        return ApiError(message, None, e.status_code, headers=e.headers).response()

    async def _health(self, request: HTTPRequest) -> Response:
        if not self.worker.alive:
            raise ApiError("the engine thread is not running; restart the server", status=503)
        return _json({"status": "ok"})

    def _card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "kvlab",
            "max_model_len": self.engine.model.cfg.max_seq_len,
        }

    async def _models(self, request: HTTPRequest) -> Response:
        return _json({"object": "list", "data": [self._card()]})

    async def _model(self, request: HTTPRequest) -> Response:
        self._check_model(request.path_params["model"])
        return _json(self._card())

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(f"model: {_SHOW.repr(model)}; allowed: {self.model_name!r}", "model", 404, "model_not_found")

    # -- parsing ------------------------------------------------------------------------------------------------
    async def _body(self, request: HTTPRequest, route: str) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(f"body: not valid JSON ({e}); allowed: a JSON object") from None
        except RecursionError:
            body = None
        if body is None or _depth(body) > MAX_DEPTH:
            raise ApiError(f"body: nested deeper than {MAX_DEPTH} levels; allowed: a JSON object of OpenAI's fields")
        if not isinstance(body, dict):
            raise ApiError(f"body: {type(body).__name__}; allowed: a JSON object")
        self._check_model(_field(body, "model", (str,), "a string"))
        for name, value in body.items():
            if name in _FIELDS[route] or name in _NO_EFFECT:
                continue
            if name in _NEUTRAL:
                allowed, neutral = _NEUTRAL[name]
                if not neutral(value):
                    raise _refuse(name, value, f"{allowed} (kvlab serve does not implement {name})")
            else:
                raise _refuse(name, value, f"none: kvlab serve does not implement {_text(name, 'body')!r}")
        return body

    def _sampling(self, body: dict, chat: bool, vocab: int) -> tuple[SamplingParams, int, tuple[str, ...], int | None]:
        """The request's sampling, ``n``, stop strings and logprobs count (None: not asked for)."""
        temperature = _number(body, "temperature", 0, math.inf, "a finite number >= 0 (0 is greedy)") or 0
        top_p = _number(body, "top_p", math.ulp(0), 1, "a number in (0, 1]")
        top_k = _field(body, "top_k", (int,), "an integer >= 1, or -1 or 0 for none")
        if top_k is not None and top_k < -1:
            raise _refuse("top_k", top_k, "an integer >= 1, or -1 or 0 for none")
        seed = _field(body, "seed", (int,), "an integer")
        n = _field(body, "n", (int,), f"an integer from 1 to {MAX_N}", 1)
        if not 1 <= n <= MAX_N:
            raise _refuse("n", n, f"an integer from 1 to {MAX_N}")
        if body.get("best_of") not in (None, n):
            raise _refuse("best_of", body["best_of"], f"null or n ({n}): kvlab serve returns every choice it draws")
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop
        if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):
            raise _refuse("stop", stop, "a non-empty string, a list of them, or null")
        stops = tuple(_text(s, "stop") for s in stops or ())
        stop_ids = _field(body, "stop_token_ids", (list,), f"a list of token ids below {vocab}", [])
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in stop_ids):
            raise _refuse("stop_token_ids", stop_ids, f"a list of token ids below {vocab}")
        if not _field(body, "ignore_eos", (bool,), "true or false", False) and self.eos is not None:
            stop_ids = [*stop_ids, self.eos]
        if chat:
            want = _field(body, "logprobs", (bool,), "true, false or null", False)
            top = _field(body, "top_logprobs", (int,), f"an integer from 0 to {MAX_LOGPROBS}")
            if top is not None and not (want and 0 <= top <= MAX_LOGPROBS):
                raise _refuse("top_logprobs", top, f"an integer from 0 to {MAX_LOGPROBS}, with logprobs: true")
            logprobs = (top or 0) if want else None
        else:
            logprobs = _field(body, "logprobs", (int,), f"an integer from 0 to {MAX_LOGPROBS}, or null")
            if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
                raise _refuse("logprobs", logprobs, f"an integer from 0 to {MAX_LOGPROBS}, or null")
        sampling = SamplingParams(
            temperature, top_k if top_k and top_k > 0 else None, top_p, seed, frozenset(stop_ids), logprobs
        )
        return sampling, n, stops, logprobs

    def _call(self, body: dict, prompts: list[_Prompt], field: str, chat: bool) -> _Call:
        cfg = self.engine.model.cfg
        context, vocab = cfg.max_seq_len, cfg.vocab_size
        for p in prompts:
            if not p.ids:
                raise ApiError(f"{field}: empty; allowed: at least one token", field)
            if len(p.ids) >= context:
                raise ApiError(
                    f"{field}: {len(p.ids)} tokens; allowed: fewer than the model's context, {context}", field
                )
            if max(p.ids) >= vocab:
                raise ApiError(f"{field}: id {max(p.ids)}; allowed: ids below vocab_size={vocab}", field)
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        given = _field(body, name, (int,), "an integer >= 1")
        if given is not None and given < 1:
            raise _refuse(name, given, "an integer >= 1")
        max_tokens = []
        for p in prompts:  # chat, as OpenAI and vLLM do: up to the context when not given
            room = context - len(p.ids)
            max_tokens.append(given or (room if chat else min(DEFAULT_MAX_TOKENS, room)))
            if max_tokens[-1] > room:
                raise ApiError(
                    f"{name}: {given} after a {len(p.ids)}-token prompt; allowed: at most {room} (the model's "
                    f"context is {context})",
                    name,
                )
        sampling, n, stops, logprobs = self._sampling(body, chat, vocab)
        echo = _field(body, "echo", (bool,), "true or false", False)
        if echo and logprobs is not None:
            raise _refuse("echo", echo, "false when logprobs is asked for (prompt logprobs are not implemented)")
        stream = _field(body, "stream", (bool,), "true or false", False)
        options = _field(body, "stream_options", (dict,), "an object or null", {})
        include_usage = _field(options, "include_usage", (bool,), "true or false", False)
        return _Call(prompts, field, max_tokens, n, sampling, stops, logprobs, echo, stream, include_usage)

    def _prompt(self, value: str | list[int], field: str) -> _Prompt:
        if isinstance(value, str):
            return _Prompt(self._with_bos(encode_text(_text(value, field))), value)
        return _Prompt(list(value), decode_text(list(value)))

    def _with_bos(self, ids: list[int]) -> list[int]:
        return ids if self.bos is None else [self.bos, *ids]

    # -- generation ---------------------------------------------------------------------------------------------
    async def _tokens(self, prompt: list[int], max_tokens: int, sampling: SamplingParams, field: str
                      ) -> AsyncIterator[tuple[int, TokenLogprobs | None]]:  # fmt: skip
        """One choice's tokens and logprobs as the engine samples them, to ``max_tokens`` or a stop token."""
        if not self.worker.alive:
            raise ApiError("the engine thread is not running; restart the server", status=503)
        if self.waiting >= self.max_waiting:
            raise ApiError(
                f"the server already has {self.waiting} requests waiting; retry later",
                None,
                429,
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue[tuple[int, TokenLogprobs | None] | ApiError] = asyncio.Queue()
        ticket = _Ticket(
            Request(prompt, max_tokens, sampling=sampling),
            field,
            lambda token, logprobs: loop.call_soon_threadsafe(tokens.put_nowait, (token, logprobs)),
            lambda error: loop.call_soon_threadsafe(tokens.put_nowait, error),
        )
        self._tickets.add(ticket)
        try:
            self.worker.submit(ticket)
            for _ in range(max_tokens):
                item = await tokens.get()
                if isinstance(item, ApiError):
                    raise item
                yield item
                if item[0] in sampling.stop_token_ids:
                    return
        finally:  # a client gone (cancelled while waiting or mid-stream) lands here too: the engine drops it
            self._tickets.discard(ticket)
            self.worker.cancel(ticket)

    async def _pieces(self, call: _Call, prompt: _Prompt, max_tokens: int, sampling: SamplingParams
                      ) -> AsyncIterator[_Piece]:  # fmt: skip
        """One choice's text, a piece per token, cut at a stop string or token (its generation then cancelled)."""
        text, stop = TextStream(), StopText(call.stops)
        n = 0
        async with aclosing(self._tokens(prompt.ids, max_tokens, sampling, call.prompt_field)) as tokens:
            async for token, logprobs in tokens:
                n += 1
                if token in sampling.stop_token_ids:  # not written: its text is no part of the answer
                    piece, hit = stop.push(text.flush())
                    yield _Piece(piece + ("" if hit else stop.flush()), None, "stop")
                    return
                last = n == max_tokens
                piece, hit = stop.push(text.push(token) + (text.flush() if last else ""))
                if hit or last:
                    yield _Piece(piece + ("" if hit else stop.flush()), logprobs, "stop" if hit else "length")
                    return
                yield _Piece(piece, logprobs, None)

    @staticmethod
    def _logprobs(pieces: list[_Piece], chat: bool, offset: int) -> dict | None:
        """OpenAI's logprobs object for ``pieces`` (completions: each token's offset in the choice's text, counted
        from ``offset``, where the text written with it starts)."""
        entries = [p.logprobs for p in pieces if p.logprobs is not None]
        if chat:

            def one(token: int, logprob: float) -> dict:
                return {"token": token_text(token), "logprob": logprob, "bytes": token_bytes(token)}

            content = [one(e.token, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]
            return {"content": content}
        offsets = []
        for p in pieces:
            if p.logprobs is not None:
                offsets.append(offset)
            offset += len(p.text)
        return {
            "tokens": [token_text(e.token) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token_text(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def _usage(self, call: _Call, completion_tokens: int) -> dict:
        prompt = sum(len(p.ids) for p in call.prompts)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
        }

    async def _respond(self, call: _Call, chat: bool) -> Response:
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": rid, "created": int(time.time()), "model": self.model_name}
        jobs = call.jobs()
        streams = [self._pieces(call, prompt, max_tokens, sampling) for _, prompt, max_tokens, sampling in jobs]
        try:  # every choice's first piece before a response starts: a refusal still gets its status
            firsts = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
            failed = [f for f in firsts if isinstance(f, BaseException)]
            if failed:
                raise failed[0]
        except BaseException:
            for s in streams:
                await s.aclose()
            raise
        logprobs = call.logprobs is not None
        echoes = [prompt.text if call.echo else "" for _, prompt, _, _ in jobs]

        if not call.stream:

            async def rest(first: _Piece, stream: AsyncIterator[_Piece]) -> list[_Piece]:
                return [first] + [p async for p in stream]

            outputs = await asyncio.gather(*(rest(f, s) for f, s in zip(firsts, streams, strict=True)))
            choices = []
            for (index, *_), echo, pieces in zip(jobs, echoes, outputs, strict=True):
                text = echo + "".join(p.text for p in pieces)
                lp = self._logprobs(pieces, chat, len(echo)) if logprobs else None
                finish = pieces[-1].finish
                choices.append(
                    {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                     "finish_reason": finish}
                    if chat else {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
                )  # fmt: skip
            used = sum(map(len, outputs))
            kind = "chat.completion" if chat else "text_completion"
            return _json({**head, "object": kind, "choices": choices, "usage": self._usage(call, used)})

        async def events() -> AsyncIterator[str]:
            kind = "chat.completion.chunk" if chat else "text_completion"
            merged: asyncio.Queue[tuple[int, _Piece | BaseException | None]] = asyncio.Queue()

            async def pump(j: int, first: _Piece, stream: AsyncIterator[_Piece]) -> None:
                try:
                    merged.put_nowait((j, first))
                    async for piece in stream:
                        merged.put_nowait((j, piece))
                    merged.put_nowait((j, None))
                except Exception as e:  # the engine failed mid-stream: the stream ends with it
                    merged.put_nowait((j, e))
                finally:
                    await stream.aclose()

            pumps = [asyncio.create_task(pump(j, f, s)) for j, (f, s) in enumerate(zip(firsts, streams, strict=True))]
            offsets, started, used, open_ = list(map(len, echoes)), [False] * len(jobs), 0, len(jobs)
            try:
                while open_:
                    j, piece = await merged.get()
                    if piece is None:
                        open_ -= 1
                        continue
                    if isinstance(piece, BaseException):
                        raise piece
                    used += 1
                    text = piece.text if started[j] else echoes[j] + piece.text
                    lp = self._logprobs([piece], chat, offsets[j]) if logprobs else None
                    offsets[j] += len(piece.text)
                    delta = {"content": text} if started[j] else {"role": "assistant", "content": text}
                    started[j] = True
                    choice = {"index": jobs[j][0]} | ({"delta": delta} if chat else {"text": text})
                    chunk = {
                        **head,
                        "object": kind,
                        "choices": [choice | {"logprobs": lp, "finish_reason": piece.finish}],
                    }
                    yield f"data: {json.dumps(chunk)}\n\n"
                if call.include_usage:
                    usage = {**head, "object": kind, "choices": [], "usage": self._usage(call, used)}
                    yield f"data: {json.dumps(usage)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                for task in pumps:
                    task.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _until_answered(self, request: HTTPRequest, answer: Awaitable[Response]) -> Response:
        """``answer``, cancelled if the client disconnects first (vLLM's ``with_cancellation``): a request still
        waiting for the engine, or generating a whole (not streamed) response, stops and frees its blocks."""
        work, gone = asyncio.ensure_future(answer), asyncio.ensure_future(_until_gone(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, gone):
                if not task.done():
                    task.cancel()
        if not work.done() or work.cancelled():
            await asyncio.gather(work, return_exceptions=True)
            return Response(status_code=499)  # nobody reads it: nginx's code for a client that closed the request
        return work.result()

    async def _completions(self, request: HTTPRequest) -> Response:
        body = await self._body(request, "completions")
        prompt = body.get("prompt")

        def is_ids(value: Any) -> bool:
            return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in value)  # fmt: skip

        if isinstance(prompt, str) or is_ids(prompt) and prompt:
            prompts = [self._prompt(prompt, "prompt")]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
            prompts = [self._prompt(p, "prompt") for p in prompt]
        elif prompt == []:
            raise ApiError("prompt: empty; allowed: at least one token", "prompt")
        else:
            raise _refuse("prompt", prompt, "a string, a list of token ids >= 0, or a list of either (a batch)")
        return await self._until_answered(request, self._respond(self._call(body, prompts, "prompt", False), False))

    async def _chat(self, request: HTTPRequest) -> Response:
        body = await self._body(request, "chat")
        messages = body.get("messages")
        allowed = (
            "a non-empty list of {'role': str, 'content': str, a list of {'type': 'text', 'text': str} parts, or "
            "null for an assistant}"
        )
        if not isinstance(messages, list) or not messages:
            raise _refuse("messages", messages, allowed)
        lines = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or set(m) - {"role", "content"}:
                raise _refuse(f"messages[{i}]", m, allowed)
            role, content = _text(m["role"], f"messages[{i}].role"), m.get("content")
            if (
                isinstance(content, list)
                and content
                and all(
                    isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) and len(p) == 2
                    for p in content
                )
            ):
                content = "\n".join(p["text"] for p in content)  # vLLM joins text parts so
            elif content is None and role == "assistant":
                content = ""
            elif not isinstance(content, str):
                raise _refuse(f"messages[{i}].content", content, allowed)
            lines.append(f"{role}: {_text(content, f'messages[{i}].content')}\n")
        text = "".join(lines) + "assistant: "
        call = self._call(body, [_Prompt(self._with_bos(encode_text(text)), text)], "messages", True)
        return await self._until_answered(request, self._respond(call, True))


# -- the model ----------------------------------------------------------------------------------------------------
def load_model(spec: str, device: str | None = None) -> tuple[Decoder, str, int | None, int | None]:
    """``spec``: a shipped checkpoint, a local Hugging Face folder, or a runnable preset (random weights, seed 0).
    Returns the model, the name it is served as, the token to put before every text prompt (or None), and the token
    that ends a text (a shipped checkpoint's ``<|endoftext|>``; None for the others: their ids are not the kvlab
    tokenizer's, so no id of theirs is known to end a text)."""
    from kvlab.model.pretrained import bos_token, list_pretrained, load_pretrained
    from kvlab.spec.presets import get_model

    if spec in list_pretrained():
        return load_pretrained(spec, device), spec, bos_token(spec), EOT
    if Path(spec).is_dir():
        from kvlab.model.hf import from_hf

        return from_hf(spec, device), Path(spec).resolve().name, None, None
    cfg = get_model(spec, "model")
    return Decoder(cfg, device=device), spec, None, None


def run_server(server: Server, host: str, port: int) -> None:
    """Serve ``server.app`` with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(server.app, host=host, port=port, log_level="info")
