"""``kvlab serve`` against the clients serving teams use, on loopback: vLLM's benchmark_serving.py request shapes
(``openai`` and ``openai-chat`` backends, sent and parsed as its aiohttp client does), and the official ``openai``
client's sampling, stop, logprobs, ``n``, ``echo``, batches and chat forms, streamed and not."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import aiohttp
import openai
import pytest
import torch

from kvlab.engine import Engine
from kvlab.model.decoder import Decoder
from kvlab.model.tokenizer import encode
from kvlab.serving.server import Server, StopText, decode_text, token_text

from .test_serve import CFG, NAME, serving, solo_text, wait_for_free_blocks


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Server, str]]:
    server = Server(Engine(Decoder(CFG), n_blocks=64, block_size=4, max_batch=8), NAME)
    with serving(server) as url:
        yield server, url


@pytest.fixture
def client(served: tuple[Server, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[1]}/v1", api_key="unused", max_retries=0)


def streamed_text(stream, chat: bool = False) -> tuple[str, str | None]:
    """The text of choice 0 and its finish reason."""
    text, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += (c.delta.content or "") if chat else c.text
            finish = c.finish_reason or finish
    return text, finish


# -- vLLM's benchmark client ------------------------------------------------------------------------------------
async def vllm_request(url: str, chat: bool, prompt: str, output_len: int) -> tuple[str, int | None, int]:
    """One request as vLLM's benchmarks/backend_request_func.py sends and parses it (openai / openai-chat backends):
    its payload, its line-by-line SSE reading, its rules for text and ``usage``. Returns the text, the output token
    count from ``usage``, and the number of chunks it timed."""
    payload = {"model": NAME, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
               "ignore_eos": True}  # fmt: skip
    if chat:
        payload |= {"messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
                    "max_completion_tokens": output_len}  # fmt: skip
    else:  # older versions send best_of, newer ones repetition_penalty; both at the value that changes nothing
        payload |= {"prompt": prompt, "max_tokens": output_len, "logprobs": None, "best_of": 1,
                    "repetition_penalty": 1.0}  # fmt: skip
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    headers = {"Content-Type": "application/json", "Authorization": "Bearer None"}
    text, output_tokens, timed = "", None, 0
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + endpoint, json=payload, headers=headers) as response,
    ):
        assert response.status == 200, await response.text()
        async for chunk_bytes in response.content:
            chunk_bytes = chunk_bytes.strip()
            if not chunk_bytes:
                continue
            chunk = chunk_bytes.decode("utf-8").removeprefix("data: ")
            if chunk == "[DONE]":
                continue
            data = json.loads(chunk)
            if choices := data.get("choices"):
                timed += 1
                text += (choices[0]["delta"].get("content") or "") if chat else (choices[0].get("text") or "")
            elif usage := data.get("usage"):
                output_tokens = usage.get("completion_tokens")
    return text, output_tokens, timed


@pytest.mark.parametrize("chat", [False, True], ids=["openai", "openai-chat"])
def test_vllm_benchmark_request_shapes_run_unchanged(served: tuple[Server, str], chat: bool) -> None:
    server, url = served
    prompt = "Lorem ipsum dolor sit"

    async def four() -> list[tuple[str, int | None, int]]:
        return await asyncio.gather(*(vllm_request(url, chat, prompt, 6) for _ in range(4)))

    rendered = f"user: {prompt}\nassistant: " if chat else prompt
    for text, output_tokens, timed in asyncio.run(four()):
        assert output_tokens == 6 and timed == 6
        assert text == solo_text(server, encode(rendered), 6)
    wait_for_free_blocks(server.engine)


# -- sampling ----------------------------------------------------------------------------------------------------
def test_a_seed_reproduces_a_sampled_completion_streamed_and_not(client: openai.OpenAI) -> None:
    kwargs = dict(model=NAME, prompt="def f(", max_tokens=8, temperature=1.0, top_p=0.95, seed=5)
    whole = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == whole
    assert streamed_text(client.completions.create(**kwargs, stream=True))[0] == whole
    assert client.completions.create(**kwargs | {"seed": 6}).choices[0].text != whole
    choices = client.completions.create(**kwargs, n=2).choices  # choice i draws with seed + i
    assert [c.index for c in choices] == [0, 1]
    assert choices[0].text == whole
    assert choices[1].text == client.completions.create(**kwargs | {"seed": 6}).choices[0].text
    messages = [{"role": "user", "content": "hi"}]
    chat = dict(model=NAME, messages=messages, max_tokens=6, temperature=0.7, seed=1, extra_body={"top_k": 20})
    whole = client.chat.completions.create(**chat).choices[0].message.content
    assert streamed_text(client.chat.completions.create(**chat, stream=True), chat=True)[0] == whole


def test_stop_strings_cut_the_text_streamed_and_not(served: tuple[Server, str], client: openai.OpenAI) -> None:
    server, _ = served
    prompt = "import "
    greedy = solo_text(server, encode(prompt), 30)
    stop = next(greedy[i : i + 2] for i in range(4, 20) if "\ufffd" not in greedy[i : i + 2])
    want = greedy[: greedy.index(stop)]
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=30, stop=[stop, "never in it \x00"])
    assert (out.choices[0].text, out.choices[0].finish_reason) == (want, "stop")
    stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=30, stop=stop, stream=True)
    assert streamed_text(stream) == (want, "stop")
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=30, stop="never in it \x00")
    assert (out.choices[0].text, out.choices[0].finish_reason) == (greedy, "length")
    wait_for_free_blocks(server.engine)


@pytest.mark.parametrize(
    ("pieces", "stops"),
    [(["ab", "c\n", "d"], ("c\nd",)), (["a", "b", "a", "bc"], ("abc",)), (["xy", "z"], ("yq", "q")),
     (["one", " two"], ("o t", "e t")), (["aaa"], ("aab",))],
)  # fmt: skip
def test_stop_text_holds_back_only_what_could_start_a_stop_string(pieces: list[str], stops: tuple[str, ...]) -> None:
    text = "".join(pieces)
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    want = text[: min(found)] if found else text
    stop, written, hit = StopText(stops), "", False
    for piece in pieces:
        out, hit = stop.push(piece)
        written += out
        assert want.startswith(written)  # never a character a stop string later takes back
        if hit:
            break
    assert written + ("" if hit else stop.flush()) == want


def test_ignore_eos_and_stop_token_ids(
    served: tuple[Server, str], client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, _ = served
    ids = server.engine.model.generate(encode("class "), 12).tolist()
    eos = ids[5]
    cut = ids[: ids.index(eos)]
    monkeypatch.setattr(server, "eos", eos)  # as a shipped checkpoint's <|endoftext|>
    out = client.completions.create(model=NAME, prompt="class ", max_tokens=12)
    assert (out.choices[0].text, out.choices[0].finish_reason) == (decode_text(cut), "stop")
    assert out.usage.completion_tokens == len(cut) + 1  # the end token is generated, not written
    out = client.completions.create(model=NAME, prompt="class ", max_tokens=12, extra_body={"ignore_eos": True})
    assert (out.choices[0].text, out.choices[0].finish_reason) == (decode_text(ids), "length")
    stream = client.completions.create(model=NAME, prompt="class ", max_tokens=12, stream=True,
                                       extra_body={"ignore_eos": True, "stop_token_ids": [ids[2]]})  # fmt: skip
    assert streamed_text(stream) == (decode_text(ids[: ids.index(ids[2])]), "stop")


def test_logprobs_streamed_and_not(served: tuple[Server, str], client: openai.OpenAI) -> None:
    server, _ = served
    prompt = encode("x = ")
    model = server.engine.model
    ids = model.generate(prompt, 5).tolist()
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([prompt + ids]))[0, len(prompt) - 1 : -1].float(), -1)
    chosen = want[range(5), ids]

    whole = client.completions.create(model=NAME, prompt=prompt, max_tokens=5, logprobs=3).choices[0]
    out = whole.logprobs
    assert out.tokens == [token_text(t) for t in ids]
    # each token's offset is where the text written with it starts: a held-back byte's text lands with a later token
    assert out.text_offset[0] == 0 and out.text_offset == sorted(out.text_offset)
    assert out.text_offset[-1] <= len(whole.text)
    torch.testing.assert_close(torch.tensor(out.token_logprobs), chosen, rtol=1e-4, atol=1e-4)
    assert all(len(top) == 3 and max(top.values()) == pytest.approx(lp, abs=1e-4)  # greedy: the chosen is the top
               for top, lp in zip(out.top_logprobs, out.token_logprobs, strict=True))  # fmt: skip
    stream = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=5, logprobs=3, stream=True))
    streamed = [lp for c in stream for lp in c.choices[0].logprobs.token_logprobs]
    torch.testing.assert_close(torch.tensor(streamed), chosen, rtol=1e-4, atol=1e-4)
    assert [o for c in stream for o in c.choices[0].logprobs.text_offset] == out.text_offset

    messages = [{"role": "user", "content": "hi"}]
    chat = dict(model=NAME, messages=messages, max_tokens=4, logprobs=True, top_logprobs=2)
    content = client.chat.completions.create(**chat).choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob
                                     for e in content)  # fmt: skip
    streamed = [e for c in client.chat.completions.create(**chat, stream=True) for e in c.choices[0].logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
    torch.testing.assert_close(torch.tensor([e.logprob for e in streamed]), torch.tensor([e.logprob for e in content]),
                               rtol=1e-4, atol=1e-4)  # fmt: skip


# -- request forms ------------------------------------------------------------------------------------------------
def test_prompt_batches_echo_and_chat_forms(served: tuple[Server, str], client: openai.OpenAI) -> None:
    server, _ = served
    out = client.completions.create(model=NAME, prompt=["def ", "class "], max_tokens=4)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [solo_text(server, encode(p), 4) for p in ("def ", "class ")]
    assert out.usage.prompt_tokens == 10 and out.usage.completion_tokens == 8
    stream = client.completions.create(model=NAME, prompt=[[5, 6], [7]], max_tokens=3, n=2, stream=True)
    texts = ["", "", "", ""]
    for chunk in stream:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [solo_text(server, [5, 6], 3)] * 2 + [solo_text(server, [7], 3)] * 2

    out = client.completions.create(model=NAME, prompt="def ", max_tokens=3, echo=True)
    assert out.choices[0].text == "def " + solo_text(server, encode("def "), 3)

    parts = [{"type": "text", "text": "be"}, {"type": "text", "text": "terse"}]
    messages = [{"role": "user", "content": parts}, {"role": "assistant", "content": None},
                {"role": "user", "content": "why?"}]  # fmt: skip
    rendered = encode("user: be\nterse\nassistant: \nuser: why?\nassistant: ")
    out = client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=3)
    assert out.choices[0].message.content == solo_text(server, rendered, 3)
    out = client.chat.completions.create(model=NAME, messages=messages)  # no max_tokens: up to the context
    assert out.usage.completion_tokens == CFG.max_seq_len - len(rendered)
    assert out.choices[0].finish_reason == "length"


def test_the_onnx_runtime_serves_what_the_eager_one_does(served: tuple[Server, str], client: openai.OpenAI) -> None:
    """``kvlab serve --runtime onnx``'s engine, asked by the official client: the same greedy completions as the
    eager server, with requests batched at different lengths (ragged decode steps)."""
    pytest.importorskip("onnxruntime")
    onnx_model = Decoder(CFG, runtime="onnx")
    onnx_model.load_state_dict(served[0].engine.model.state_dict())
    prompts = ["import os", "def f(x):\n    return", "class A", "print('hello, world')"]
    with serving(Server(Engine(onnx_model, n_blocks=64, block_size=4, max_batch=8), NAME)) as url:
        theirs = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        want, got = (  # all four prompts in one request: the engine batches them
            [c.text for c in cl.completions.create(model=NAME, prompt=prompts, max_tokens=12, temperature=0).choices]
            for cl in (client, theirs)
        )
    assert got == want
    # ONNX Runtime ran the batched steps on the paged cache, not an eager fallback
    assert max(batch for batch, _ in onnx_model._compiled_step.plans) > 1
