"""Fuzzing ``kvlab serve``'s request schema over real HTTP: whatever the fields hold (wrong types, lone surrogates,
NaN, nesting, unknown fields), the answer is a 200 or a 4xx in OpenAI's error body, never a 5xx, and the engine's
pool is idle afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvlab.engine import Engine
from kvlab.model.decoder import Decoder
from kvlab.serving.server import Server

from .test_serve import CFG, NAME, serving, wait_for_free_blocks

TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)  # what a well-formed field holds
# Texts as a client can send them and a tokenizer cannot: lone surrogates (a JavaScript string cut inside a pair)
ODD_TEXT = st.one_of(st.sampled_from(["\ud800", "a\udfffb", "<|id:99999|>", "<|endoftext|>", ""]), st.text(max_size=12))
SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), ODD_TEXT)
ANY = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ODD_TEXT, inner, max_size=3),
                   max_leaves=6)  # fmt: skip
IDS = st.lists(st.integers(0, CFG.vocab_size - 1), min_size=1, max_size=6)
# Each field drawn well formed, then up to two fields (or an unknown one) replaced by anything at all (lone
# surrogates, NaN, huge integers, nesting): many requests reach the engine, the rest probe a field's validation.
PART = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})
MESSAGE = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system", "assistant"]),
    "content": st.one_of(TEXT, st.lists(PART, min_size=1, max_size=2)),
})  # fmt: skip
ODD_MESSAGE = st.fixed_dictionaries({
    "role": st.one_of(st.sampled_from(["user", "assistant"]), ODD_TEXT),
    "content": st.one_of(ODD_TEXT, st.none(), st.lists(st.fixed_dictionaries({"type": ANY, "text": ODD_TEXT}))),
})  # fmt: skip
COMMON = {
    "model": st.just(NAME),
    "max_tokens": st.integers(1, 6),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "temperature": st.one_of(st.just(0), st.floats(0, 2)),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 12),
    "n": st.integers(1, 3),
    "best_of": st.none(),
    "seed": st.integers(-(2**70), 2**70),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3)),
    "stop_token_ids": IDS,
    "ignore_eos": st.booleans(),
    "presence_penalty": st.just(0),
    "tools": st.just([]),
    "response_format": st.just({"type": "text"}),
    "user": TEXT,
}
COMPLETION = COMMON | {
    "prompt": st.one_of(
        TEXT,
        IDS,
        st.lists(TEXT, min_size=1, max_size=3),
        st.lists(IDS, min_size=1, max_size=2),
        ODD_TEXT,
        st.lists(ODD_TEXT, min_size=1, max_size=2),
    ),  # fmt: skip
    "logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "echo": st.booleans(),
}
CHAT = COMMON | {
    "messages": st.one_of(st.lists(MESSAGE, min_size=1, max_size=3), st.lists(ODD_MESSAGE, min_size=1, max_size=2)),
    "max_completion_tokens": st.integers(1, 6),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 20),
}


def bodies(fields: dict, required: str) -> st.SearchStrategy[dict]:
    """The required field (mostly) and any subset of the others, well formed; then up to two fields replaced."""
    optional = {k: v for k, v in fields.items() if k != required}
    wrong = st.dictionaries(st.sampled_from([*fields, "unknown_field"]), st.one_of(ANY, ODD_TEXT), max_size=2)
    return st.tuples(
        st.fixed_dictionaries({}, optional={required: fields[required]}),
        st.fixed_dictionaries({}, optional=optional),
        st.one_of(st.just({}), wrong),
    ).map(lambda parts: parts[0] | parts[1] | parts[2])


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Server, str]]:
    server = Server(Engine(Decoder(CFG), n_blocks=64, block_size=4, max_batch=8), NAME, eos=7)
    with serving(server) as url:
        yield server, url


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])  # fmt: skip
@given(route=st.sampled_from(["completions", "chat/completions"]), data=st.data())
@pytest.mark.slow
def test_no_request_gets_a_5xx(served: tuple[Server, str], route: str, data: st.DataObject) -> None:
    server, url = served
    body = data.draw(bodies(COMPLETION, "prompt") if route == "completions" else bodies(CHAT, "messages"))
    with httpx.Client(timeout=60) as client:
        response = client.post(f"{url}/v1/{route}", content=json.dumps(body).encode())
        assert response.status_code < 500, response.text
        event(f"status {response.status_code}")  # --hypothesis-show-statistics: how many got through to the engine
        if response.status_code == 200:
            if response.headers["content-type"].startswith("text/event-stream"):
                assert response.text.rstrip().endswith("data: [DONE]")
            else:
                assert response.json()["choices"]
        else:
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and error["message"]
    wait_for_free_blocks(server.engine, timeout_s=2.0)
