"""The Triton decode kernels (``kvlab.kernels.triton``) against the torch reference, on the layouts the caches keep.

Without CUDA the kernels run in Triton's interpreter on CPU tensors. Triton picks the interpreter when its
``@triton.jit`` decorators run, its own library's (at ``import triton``) as well as kvlab's, and reads
``TRITON_INTERPRET`` again as a kernel runs. So this module sets the variable while it imports Triton and the
kernels (reloading the kernels if they were imported without it) and, through a fixture, while its tests run;
the rest of the session never sees it. Where some other module imported Triton itself first, without the
variable, Triton cannot be rebuilt in this process (its extension refuses a second import): the tests then run
once more in a fresh interpreter, by ``test_in_a_fresh_process``, and skip here. The interpreter costs about a
millisecond per program instance and tile, so the shapes are small: a few (row, KV head, split) programs each.
"""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys

import pytest
import torch

from kvlab.cache.base import CacheShape
from kvlab.cache.codec import kivi as quantized
from kvlab.cache.codec import stores
from kvlab.cache.codec.codecs import get_codec
from kvlab.cache.codec.kivi import QuantizedKVCache
from kvlab.cache.codec.stores import EncodedStore, FloatStore
from kvlab.cache.storage import paged
from kvlab.cache.storage.paged import PagedKVCache
from kvlab.cache.storage.slab import ContiguousKVCache
from kvlab.kernels.reference import decode_attention, partial_attention

INTERPRET = not torch.cuda.is_available()  # without CUDA, Triton's interpreter runs the kernels on the CPU
with pytest.MonkeyPatch.context() as _patch:
    if INTERPRET:
        _patch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    from triton.language.standard import zeros as _a_library_kernel
    from triton.runtime.interpreter import InterpretedFunction

    tk = importlib.import_module("kvlab.kernels.triton")
    IN_PROCESS = not INTERPRET or isinstance(_a_library_kernel, InterpretedFunction)
    if IN_PROCESS and INTERPRET and not tk.INTERPRETED:
        tk = importlib.reload(tk)  # imported earlier without the variable: rebuild its kernels for the interpreter


@pytest.fixture(autouse=True)
def interpreter(request: pytest.FixtureRequest):
    """Keep ``TRITON_INTERPRET`` set while a test runs (without CUDA); skip where this process cannot interpret."""
    if not IN_PROCESS and request.node.name != "test_in_a_fresh_process":
        pytest.skip("Triton was imported without TRITON_INTERPRET=1; test_in_a_fresh_process runs this test")
    with pytest.MonkeyPatch.context() as patch:
        if INTERPRET:
            patch.setenv("TRITON_INTERPRET", "1")
        yield


@pytest.mark.skipif(IN_PROCESS, reason="the kernels run in this process")
def test_in_a_fresh_process() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Two kernels over the same fp32 K/V (or the same decoded codes): the kernel sums scores and p @ V in tiles, in
# another order than torch's matmuls, so outputs (|x| < 4) differ by a few fp32 ulps; a wrong slot, block, scale
# or mask moves them by 1e-2 or more.
TOL = dict(rtol=1e-5, atol=1e-5)
H, G, D = 2, 3, 20  # KV heads; query heads per KV head (GQA); a head dim that is not a power of 2


def queries(gen: torch.Generator, b: int, d: int = D) -> torch.Tensor:
    """``[B, Hkv, G, D]``, scaled as the attention module scales them."""
    return torch.randn(b, H, G, d, generator=gen).to(DEVICE) * d**-0.5


def lengths(*n: int) -> torch.Tensor:
    return torch.tensor(n, dtype=torch.int32, device=DEVICE)


def float_slab(gen: torch.Generator, b: int, slots: int) -> tuple[FloatStore, FloatStore]:
    """Keys key-major and values token-major, as ``ContiguousKVCache`` keeps them, holding random K/V."""
    keys = FloatStore((b, H), slots, D, torch.float32, DEVICE, key_major=True)
    values = FloatStore((b, H), slots, D, torch.float32, DEVICE)
    for store in (keys, values):
        store.data.copy_(torch.randn(store.data.shape, generator=gen))
    return keys, values


def encoded(codec: str, lead: tuple[int, ...], slots: int, gen: torch.Generator, d: int, group_size: int):
    """Keys and values as ``EncodedStore`` keeps them (per token, ``group_size`` channels a scale), random K/V."""
    made = [EncodedStore(lead, slots, d, torch.float32, DEVICE, codec, group_size) for _ in range(2)]
    for store in made:
        store.write((slice(None),) * (len(lead) + 1), torch.randn(*lead, slots, d, generator=gen).to(DEVICE))
    return made


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: list[int], window: int | None = None):
    """``decode_attention`` per row over its own first ``n[b]`` tokens (its last ``window``): ``k``, ``v``
    token-major ``[B, Hkv, S, D]`` floats."""
    rows = []
    for i, length in enumerate(n):
        lo = 0 if window is None else max(0, length - window)
        rows.append(
            decode_attention(q[i : i + 1], k[i : i + 1, :, lo:length].transpose(-1, -2), v[i : i + 1, :, lo:length])
        )
    return torch.cat(rows)


def shuffled_pool(gen: torch.Generator, n: list[int], block_size: int, n_blocks: int) -> torch.Tensor:
    """A block table ``[B, m]`` for rows of ``n`` tokens: distinct blocks in shuffled order, padded with -1."""
    need = [math.ceil(x / block_size) for x in n]
    order = torch.randperm(n_blocks, generator=gen).tolist()
    table, used = [], 0
    for m in need:
        table.append(order[used : used + m] + [-1] * (max(need) - m))
        used += m
    return torch.tensor(table, dtype=torch.int32, device=DEVICE)


def gathered(store, table: torch.Tensor, block_size: int) -> torch.Tensor:
    """Each row's blocks copied out in position order (the gather the kernel avoids): ``[B, Hkv, m * bs, D]``."""
    return store.take_blocks(table.clamp_min(0), block_size)


def test_available_here() -> None:
    assert tk.available(DEVICE)
    assert stores.fused_kernels(torch.device("cpu")) is None  # on the CPU the caches keep the torch path


def test_contiguous_ragged_gqa() -> None:
    gen = torch.Generator().manual_seed(0)
    keys, values = float_slab(gen, 2, 40)
    q, n = queries(gen, 2), [40, 17]
    out = tk.contiguous_decode(q, keys.data, values.data, lengths(*n))
    torch.testing.assert_close(out, reference(q, keys.read(40), values.read(40), n), **TOL)


def test_contiguous_window() -> None:
    gen = torch.Generator().manual_seed(1)
    keys, values = float_slab(gen, 2, 24)
    q, n = queries(gen, 2), [23, 4]  # one row longer than the window, one shorter
    out = tk.contiguous_decode(q, keys.data, values.data, lengths(*n), window=6)
    torch.testing.assert_close(out, reference(q, keys.read(24), values.read(24), n, window=6), **TOL)


def test_half_storage_and_queries() -> None:
    """fp16 stored K/V with bf16 queries: loaded, converted and summed in fp32, returned in q's dtype."""
    gen = torch.Generator().manual_seed(2)
    k_t = torch.randn(1, H, D, 30, generator=gen).to(DEVICE, torch.float16)
    v = torch.randn(1, H, 30, D, generator=gen).to(DEVICE, torch.float16)
    q = queries(gen, 1).to(torch.bfloat16)
    out = tk.contiguous_decode(q, k_t, v, lengths(30))
    assert out.dtype == torch.bfloat16
    expected = decode_attention(q.float(), k_t.float(), v.float()).to(torch.bfloat16)
    torch.testing.assert_close(out, expected, rtol=0, atol=2**-7)  # one bf16 rounding of outputs |x| < 2


def test_paged_shuffled_ragged() -> None:
    gen = torch.Generator().manual_seed(3)
    block_size, n_blocks, n = 4, 12, [9, 14, 3]  # no length a multiple of the block size
    keys = FloatStore((H,), n_blocks * block_size, D, torch.float32, DEVICE, key_major=True)
    values = FloatStore((H,), n_blocks * block_size, D, torch.float32, DEVICE)
    for store in (keys, values):
        store.data.copy_(torch.randn(store.data.shape, generator=gen))
    table, q = shuffled_pool(gen, n, block_size, n_blocks), queries(gen, 3)
    out = tk.paged_decode(q, keys.data, values.data, table, lengths(*n), block_size)
    expected = reference(q, gathered(keys, table, block_size), gathered(values, table, block_size), n)
    torch.testing.assert_close(out, expected, **TOL)
    windowed = tk.paged_decode(q, keys.data, values.data, table, lengths(*n), block_size, window=5)
    expected = reference(q, gathered(keys, table, block_size), gathered(values, table, block_size), n, window=5)
    torch.testing.assert_close(windowed, expected, **TOL)


@pytest.mark.parametrize(
    ("codec", "d", "group_size"),
    [("fp8", 20, 8), ("int8", 20, 4), ("int4", 17, 8), ("int4", 16, 16)],  # int4: odd D, a ragged last group
)
def test_quantized_slab(codec: str, d: int, group_size: int) -> None:
    gen = torch.Generator().manual_seed(4)
    keys, values = encoded(codec, (2, H), 20, gen, d, group_size)
    q, n = queries(gen, 2, d), [20, 7]
    out = tk.quantized_decode(q, keys.stored, values.stored, lengths(*n))
    torch.testing.assert_close(out, reference(q, keys.read(20), values.read(20), n), **TOL)


@pytest.mark.parametrize("codec", ["fp8", "int4"])
def test_quantized_paged(codec: str) -> None:
    gen = torch.Generator().manual_seed(5)
    block_size, n_blocks, n = 4, 10, [10, 5]
    keys, values = encoded(codec, (H,), n_blocks * block_size, gen, 17, 8)
    table, q = shuffled_pool(gen, n, block_size, n_blocks), queries(gen, 2, 17)
    out = tk.decode(q, keys, values, lengths(*n), table=table, block_size=block_size)
    expected = reference(q, gathered(keys, table, block_size), gathered(values, table, block_size), n)
    torch.testing.assert_close(out, expected, **TOL)


@pytest.mark.parametrize("codec", ["int8", "int4", "fp8"])
def test_kivi_grouping(codec: str) -> None:
    """KIVI's layout (``QuantizedKVCache``): keys grouped along tokens (a scale per channel), values per token."""
    gen = torch.Generator().manual_seed(6)
    k, v = (torch.randn(2, H, 24, D, generator=gen).to(DEVICE) for _ in range(2))
    c = get_codec(codec)
    keys, values = c.encode(k, 2, 8), c.encode(v, 3, 8)
    q, n = queries(gen, 2), [24, 13]
    out, lse = tk.quantized_decode(q, keys, values, lengths(*n), return_lse=True)
    torch.testing.assert_close(out, reference(q, c.decode(keys), c.decode(values), n), **TOL)
    _, expected_lse = partial_attention(
        q[1:], c.decode(keys)[1:, :, :13].transpose(-1, -2), c.decode(values)[1:, :, :13]
    )
    torch.testing.assert_close(lse[1:], expected_lse, **TOL)


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_split_k_equals_unsplit(codec: str) -> None:
    """Flash-decoding at batch 1: spans' partial (out, lse), merged, equal the one-span result, the lse too."""
    gen = torch.Generator().manual_seed(7)
    block_size, n_blocks, n = 16, 20, [300]
    if codec == "fp32":
        keys = FloatStore((H,), n_blocks * block_size, D, torch.float32, DEVICE, key_major=True)
        values = FloatStore((H,), n_blocks * block_size, D, torch.float32, DEVICE)
        for store in (keys, values):
            store.data.copy_(torch.randn(store.data.shape, generator=gen))
    else:
        keys, values = encoded(codec, (H,), n_blocks * block_size, gen, D, 4)
    table, q = shuffled_pool(gen, n, block_size, n_blocks), queries(gen, 1)
    args = (q, keys, values, lengths(*n))
    whole = tk.decode(*args, table=table, block_size=block_size, n_splits=1, return_lse=True)
    split = tk.decode(*args, table=table, block_size=block_size, n_splits=4, return_lse=True)
    for got, expected in zip(split, whole, strict=True):
        torch.testing.assert_close(got, expected, **TOL)
    expected = reference(q, gathered(keys, table, block_size), gathered(values, table, block_size), n)
    torch.testing.assert_close(split[0], expected, **TOL)


def test_split_with_empty_spans_and_window() -> None:
    """Spans past a short row's length are empty (lse -inf, weight 0); a window's spans start at its first token."""
    gen = torch.Generator().manual_seed(8)
    keys, values = float_slab(gen, 2, 64)
    q, n = queries(gen, 2), [64, 5]
    for window in (None, 40):
        out = tk.contiguous_decode(q, keys.data, values.data, lengths(*n), window=window, n_splits=4)
        torch.testing.assert_close(out, reference(q, keys.read(64), values.read(64), n, window), **TOL)


def test_default_splits() -> None:
    assert tk.default_splits(rows=8, tokens=32768) == 16  # batch 1, long context: 128 programs
    assert tk.default_splits(rows=1, tokens=32768) == tk.MAX_SPLITS
    assert tk.default_splits(rows=8, tokens=1000) == 1  # too short to pay for a merge
    assert tk.default_splits(rows=256, tokens=32768) == 1  # the batch already fills the GPU


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"n": torch.tensor([3])}, "lengths"),
        ({"n_splits": 0}, "n_splits"),
        ({"window": 0}, "window"),
        ({"n": torch.tensor([3.0, 3.0])}, "lengths"),
    ],
)
def test_bad_arguments_name_themselves(kwargs: dict, named: str) -> None:
    gen = torch.Generator().manual_seed(9)
    keys, values = float_slab(gen, 2, 8)
    n = kwargs.pop("n", lengths(3, 3)).to(DEVICE)
    with pytest.raises(ValueError, match=named):
        tk.contiguous_decode(queries(gen, 2), keys.data, values.data, n, **kwargs)


def test_bad_layouts_name_themselves() -> None:
    gen = torch.Generator().manual_seed(10)
    floats = float_slab(gen, 1, 8)
    codes = encoded("int8", (1, H), 8, gen, D, 4)
    with pytest.raises(ValueError, match="values"):
        tk.decode(queries(gen, 1), floats[0], codes[1], lengths(8))
    by_token = get_codec("int8").encode(torch.randn(H, 8, D, device=DEVICE), 1, 4)  # a pool grouped along its slots
    table = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="group_dim"):
        tk.quantized_decode(queries(gen, 1), by_token, by_token, lengths(8), table=table, block_size=4)


# -- the caches' dispatch: what they run on CUDA, run here through the interpreter ---------------------------------
SHAPE = CacheShape(n_layers=1, n_kv_heads=H, head_dim=16, device=DEVICE)


def step(cache, gen: torch.Generator, n: int, batch: int) -> None:
    """Store ``n`` new tokens of random K/V per row."""
    cache.reserve(n)
    cache.append(0, *(torch.randn(batch, n, H, SHAPE.head_dim, generator=gen).to(DEVICE) for _ in range(2)))


class Counted:
    """``kvlab.kernels.triton`` with a count of the kernel calls made through it."""

    def __init__(self) -> None:
        self.calls = 0

    def __getattr__(self, name: str):
        target = getattr(tk, name)
        if not callable(target):  # the module's constants (CODECS), as they are
            return target

        def call(*args, **kwargs):
            self.calls += 1
            return target(*args, **kwargs)

        return call


def attend_both_ways(cache, q: torch.Tensor, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache.attend`` through the Triton kernels, as on CUDA, and through the torch path it takes here."""
    expected, kernels = cache.attend(0, q, window), Counted()
    with pytest.MonkeyPatch.context() as patch:
        for module in (stores, paged, quantized):
            patch.setattr(module, "fused_kernels", lambda device: kernels)
        got = cache.attend(0, q, window)
    assert kernels.calls == 1  # one launch for the batch, ragged or not
    return got, expected


@pytest.mark.parametrize("codec", ["fp32", "int4"])
def test_paged_cache_ragged_step(codec: str) -> None:
    gen = torch.Generator().manual_seed(11)
    cache = PagedKVCache(SHAPE, n_blocks=16, block_size=4, codec=codec)
    ids = []
    for n in (9, 5, 14):
        seq_id, _ = cache.new_sequence()
        ids.append(seq_id)
        cache.use([seq_id])
        step(cache, gen, n, 1)
    cache.use(ids)
    step(cache, gen, 1, 3)
    q = torch.randn(3, H, 2, 1, 16, generator=gen).to(DEVICE) / 4
    for window in (None, 6):
        got, expected = attend_both_ways(cache, q, window)
        torch.testing.assert_close(got, expected, **TOL)


def test_contiguous_cache_int8_window(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(12)
    cache = ContiguousKVCache(SHAPE, batch_size=2, capacity=32, codec="int8")
    step(cache, gen, 19, 2)
    step(cache, gen, 1, 2)
    got, expected = attend_both_ways(cache, torch.randn(2, H, 2, 1, 16, generator=gen).to(DEVICE), 7)
    torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize("key_quant", ["per-channel", "per-token"])
def test_quantized_cache_step(key_quant: str) -> None:
    """KIVI: the kernel over the quantized tokens, merged by lse with the full-precision residual ring."""
    gen = torch.Generator().manual_seed(13)
    cache = QuantizedKVCache(
        SHAPE, capacity=40, codec="int4", group_size=4, residual=4, chunk_size=8, key_quant=key_quant
    )
    step(cache, gen, 21, 1)
    step(cache, gen, 1, 1)
    got, expected = attend_both_ways(cache, torch.randn(1, H, 2, 1, 16, generator=gen).to(DEVICE))
    torch.testing.assert_close(got, expected, **TOL)
