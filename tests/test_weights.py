"""kvlab.model.weights: int8 weights through PyTorch's quantized kernel, half-precision weights, and the Decoder's
weight_dtype."""

import copy as copy_module
import pickle
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import kvlab.model.weights
from autograde import hidden
from kvlab import Decoder
from kvlab.checks import check_int8_weight_bytes
from kvlab.machine.isa import capped_environ
from kvlab.measure.step_time import layer_weights
from kvlab.model.weights import (
    WeightFormat,
    int8_step_weight_bytes,
    int8_weight_bytes,
    projection_shapes,
    quantize_int8,
)
from kvlab.roofline import weight_bytes_read

from .helpers import tiny_config


def test_int8_quantization_is_per_output_channel_and_within_half_a_step():
    w = torch.randn(32, 6) * torch.tensor([1e-3, 1.0, 5.0, 0.1, 2.0, 0.0])  # columns = output channels
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == (6, 32) and scale.shape == (6,)
    assert q[:5].abs().amax(dim=1).tolist() == [127] * 5  # each channel's largest weight uses the full range
    err = (q.float() * scale[:, None] - w.T).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-7).all())
    assert int8_weight_bytes((32, 6)) == 32 * 6 + 4 * 6


def test_int8_product_within_activation_quantization_error_and_repacks_on_edit():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 1, 64, generator=gen), torch.randn(64, 40, generator=gen) * 0.05
    fmt = WeightFormat("int8")
    q, scale = quantize_int8(w)
    dequantized = (q.float() * scale[:, None]).T
    with torch.inference_mode():
        out = fmt.matmul(x, w)
        # The activation row is quantized to 7 bits (reduce_range: AVX2's int16 products would saturate on 8):
        # each element moves by at most half a step of (max - min) / 127, so a column moves by at most that
        # times the column's absolute sum.
        bound = float((x.amax() - x.amin()) / 127 / 2 * dequantized.abs().sum(dim=0).max())
        assert_close(out, x @ dequantized, rtol=0, atol=bound)
        with torch.no_grad():
            w.neg_()
        assert_close(fmt.matmul(x, w), -out, rtol=0, atol=2 * bound)


def next_logits(model: Decoder, tokens: torch.Tensor) -> torch.Tensor:
    """The logits of one decode step of ``tokens``' last column, after all of ``tokens`` ``[batch, n]`` prefilled."""
    cache = model.new_cache(tokens.shape[0], tokens.shape[1] + 4)
    model.prefill(tokens, cache)
    return model.decode_step(tokens[:, -1], cache)


def test_decoder_int8_reads_a_quarter_of_the_bytes_and_stays_close_to_fp32():
    cfg = tiny_config(d_model=128, d_ff=256, vocab_size=512)
    fp32, int8 = Decoder(cfg, device="cpu", seed=0), Decoder(cfg, device="cpu", seed=7, weight_dtype="int8")
    assert fp32.weight_dtype == "fp32" and fp32.cfg.weight_dtypes is None
    int8.load_state_dict(fp32.state_dict())  # the packed copies follow the loaded weights
    assert int8.weight_dtype == "int8" and dict(int8.cfg.weight_dtypes) == {"embeddings": "int8", "other": "int8"}
    assert weight_bytes_read(int8.cfg) * 4 == pytest.approx(weight_bytes_read(fp32.cfg), rel=0.01)
    tokens = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(2))
    logits = {name: next_logits(model, tokens) for name, model in (("fp32", fp32), ("int8", int8))}
    spread = float(logits["fp32"].std())
    assert_close(logits["int8"], logits["fp32"], rtol=0, atol=0.1 * spread)
    assert not torch.equal(logits["int8"], logits["fp32"])  # the int8 kernel really ran


def test_weight_dtype_errors_and_half_precision_warning(monkeypatch):
    with pytest.raises(ValueError, match="weight_dtype.*allowed: fp32, bf16, fp16, int8"):
        Decoder(tiny_config(), device="cpu", weight_dtype="int4")
    monkeypatch.setattr(kvlab.model.weights, "onednn_bf16", lambda: False)
    with pytest.warns(RuntimeWarning, match="no kernel that reads bf16 weights at memory speed"):
        Decoder(tiny_config(), device="cpu", weight_dtype="bf16")
    monkeypatch.setattr(kvlab.model.weights, "native_half", lambda dtype: True)
    with torch.inference_mode():
        model = Decoder(tiny_config(), device="cpu", weight_dtype="fp16")
        cache = model.new_cache(1, 4)
        assert model.decode_step(torch.tensor([3]), cache).dtype == torch.float32


fbgemm = pytest.mark.skipif(not kvlab.model.weights.fbgemm_fp16(), reason="fbgemm's fp16 kernel needs x86 with AVX2")


@fbgemm
@pytest.mark.parametrize("tie", [False, True])
def test_fp16_weights_run_on_fbgemm_with_fp32_activations(tie):
    cfg = tiny_config(d_model=128, d_ff=256, vocab_size=512, tie_embeddings=tie)
    fp32, fp16 = Decoder(cfg, device="cpu", seed=0), Decoder(cfg, device="cpu", seed=7, weight_dtype="fp16")
    with torch.no_grad():  # weights fp16 holds exactly: the fp32 model then multiplies by what fbgemm reads
        for p in fp32.parameters():
            p.copy_(p.half().float())
    tokens = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(3))
    next_logits(fp16, tokens)  # packs seed 7's weights
    fp16.load_state_dict(fp32.state_dict())  # the packed copies follow the loaded weights
    logits = {name: next_logits(model, tokens) for name, model in (("fp32", fp32), ("fp16", fp16))}
    # Activations stay fp32: only the summation order differs. Casting the activations to fp16 as well (the
    # kernel-less path) moves the logits by about 1e-3 of their spread, which this tolerance would catch.
    spread = float(logits["fp32"].std())
    assert_close(logits["fp16"], logits["fp32"], rtol=0, atol=1e-5 * spread)
    assert all(not isinstance(p, torch.Tensor) for *_, p in fp16.weights._packed.values())  # fbgemm's packed weights


@pytest.mark.skipif(not kvlab.model.weights.onednn_bf16(), reason="oneDNN's bf16 product needs native bf16")
def test_bf16_weights_on_onednns_reordered_weight_match_torchs_bf16_product(monkeypatch):
    cfg = tiny_config(d_model=128, d_ff=256, vocab_size=512, tie_embeddings=True)
    fp32 = Decoder(cfg, device="cpu", seed=0)
    tokens = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(3))
    logits, kernels = {}, {}
    for reordered in (True, False):
        monkeypatch.setattr(kvlab.model.weights, "onednn_bf16", lambda reordered=reordered: reordered)
        with warnings.catch_warnings():  # the cast path warns that it is slow
            warnings.simplefilter("ignore", RuntimeWarning)
            model = Decoder(cfg, device="cpu", weight_dtype="bf16")
        model.load_state_dict(fp32.state_dict())
        logits[reordered] = next_logits(model, tokens)
        kernels[reordered] = model.weights.kernel(model.embed.weight.T)  # the tied head
    assert kernels == {True: "onednn-bf16", False: "cast"}
    # Both multiply bf16 by bf16 with fp32 sums; only their blocking may differ.
    assert_close(logits[True], logits[False], rtol=0, atol=1e-2 * float(logits[False].std()))


def test_half_precision_off_the_cpu_keeps_torchs_product():
    meta = torch.empty(16, 8, device="meta")
    assert WeightFormat("fp16").kernel(meta) == WeightFormat("bf16").kernel(meta) == "cast"
    assert WeightFormat("int8").kernel(torch.empty(16, 8)) == "int8"


def test_half_precision_warns_only_where_no_kernel_reads_it_and_fp16_refuses_what_it_cannot_hold(monkeypatch):
    monkeypatch.setattr(kvlab.model.weights, "fbgemm_fp16", lambda: True)
    monkeypatch.setattr(kvlab.model.weights, "onednn_bf16", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        WeightFormat("fp16")
        WeightFormat("bf16", device="meta")  # off the CPU, torch's own product is the one to use
    with pytest.warns(RuntimeWarning, match="no kernel that reads bf16 weights.*AVX512-BF16 or AMX"):
        WeightFormat("bf16")  # fbgemm has no bf16 kernel
    monkeypatch.setattr(kvlab.model.weights, "fbgemm_fp16", lambda: False)
    with pytest.warns(RuntimeWarning, match="no kernel that reads fp16 weights.*x86 CPU with AVX2"):
        fmt = WeightFormat("fp16")
    for bad, shown in ((-7e4, "70000"), (float("nan"), "nan")):
        w = torch.randn(16, 8)
        w[3, 2] = bad
        with pytest.raises(ValueError, match=rf"weight_dtype='fp16'.*\(16, 8\) holds {shown}, outside.*allowed"):
            fmt.matmul(torch.randn(1, 16), w)
    meta = torch.empty(16, 8, device="meta")
    assert fmt.matmul(torch.empty(2, 16, device="meta"), meta).shape == (2, 8)  # no range to check on meta


def _avx2_cap() -> dict[str, str] | None:
    try:
        return capped_environ("avx2")
    except ValueError:  # not x86, or no AVX2
        return None


@pytest.mark.slow
@pytest.mark.skipif(_avx2_cap() is None, reason="caps x86 kernels at AVX2: needs an x86 CPU with AVX2")
def test_this_file_passes_on_the_kernels_an_avx2_only_cpu_runs():
    """Most learners' laptops have AVX2 and no AVX-512: fbgemm's AVX2 fp16 kernel, no native bf16. On a CPU with
    more, every library capped at AVX2 runs those kernels, and this file's tests must hold on them too."""
    env, root = _avx2_cap(), Path(__file__).resolve().parent.parent
    probe = (
        "import torch, kvlab.model.weights as w;"
        "print(torch.backends.cpu.get_cpu_capability(), w.weight_kernel('fp16', 'cpu'), w.weight_kernel('bf16', 'cpu'))"
    )
    seen = subprocess.run([sys.executable, "-c", probe], env=env, cwd=root, capture_output=True, text=True, check=True)
    assert seen.stdout.split() == ["AVX2", "fbgemm-fp16", "cast"]
    tests = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    run = subprocess.run([*tests, "-k", "not avx2_only_cpu"], env=env, cwd=root, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


@pytest.mark.parametrize("weight_dtype", ["int8", "fp16"])
def test_a_model_with_packed_weights_copies_and_pickles_without_them(weight_dtype):
    with warnings.catch_warnings():  # fp16 on a CPU no kernel reads it warns; this test is about copies
        warnings.simplefilter("ignore", RuntimeWarning)
        model = Decoder(tiny_config(), device="cpu", weight_dtype=weight_dtype)
    token = torch.tensor([3])
    before = model.decode_step(token, model.new_cache(1, 4))
    assert model.weights._packed
    for copy in (copy_module.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert not copy.weights._packed
        assert_close(copy.decode_step(token, copy.new_cache(1, 4)), before, rtol=0, atol=0)


def test_a_packed_copy_is_never_served_to_a_new_weight_in_a_freed_ones_memory():
    fmt = WeightFormat("int8")
    with torch.inference_mode():
        for i in range(1, 21):
            w = torch.full((64, 64), float(i))  # often allocated where the previous iteration's was
            # Constant rows and columns quantize exactly, so the product is exact.
            assert_close(fmt.matmul(torch.ones(1, 64), w), torch.full((1, 64), 64.0 * i), rtol=1e-6, atol=0)
            del w
    assert not fmt._packed  # each entry went with its weight


@pytest.mark.parametrize("overrides", [{}, {"n_kv_heads": 1, "head_dim": 24, "tie_embeddings": True}])
def test_projection_shapes_are_the_matrices_the_model_multiplies_by(overrides):
    model = Decoder(tiny_config(**overrides), device="cpu")
    matrices = [w for layer in layer_weights(model) for w in layer]
    assert projection_shapes(model.cfg) == [tuple(w.shape) for w in matrices]
    assert int8_step_weight_bytes(model.cfg) == sum(int8_weight_bytes(tuple(w.shape)) for w in matrices)


def test_int8_weight_bytes_checker_passes_the_reference_and_fails_the_slips():
    check_int8_weight_bytes(int8_step_weight_bytes)
    hidden.check_int8_weight_bytes(int8_step_weight_bytes)
    no_scales = lambda cfg: sum(i * o for i, o in projection_shapes(cfg))  # noqa: E731
    scale_per_input = lambda cfg: sum(i * o + 4 * i for i, o in projection_shapes(cfg))  # noqa: E731
    no_head = lambda cfg: int8_step_weight_bytes(cfg) - int8_weight_bytes((cfg.d_model, cfg.vocab_size))  # noqa: E731
    for slip in (no_scales, scale_per_input, no_head):
        with pytest.raises(AssertionError, match="int8_weight_bytes"):
            check_int8_weight_bytes(slip)
        with pytest.raises(AssertionError, match="int8_weight_bytes"):
            hidden.check_int8_weight_bytes(slip)


@pytest.fixture
def threads():
    """Set torch's thread count for one test and restore it afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("blocks", [2, 3, 4])
def test_column_blocks_product_is_the_plain_product(blocks):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 12 * 64, generator=gen)
    tied = torch.randn(12 * 64, 96, generator=gen).T  # a tied LM head: the embedding's transpose, not contiguous
    for x in (torch.randn(1, 96, generator=gen), torch.randn(2, 3, 96, generator=gen)):
        for weight in (w, tied):
            out = kvlab.model.weights.column_blocks_matmul(x, weight, blocks)
            assert out.shape == (*x.shape[:-1], weight.shape[1])
            assert_close(out, x @ weight, rtol=1e-5, atol=1e-5)


def test_columns_split_only_where_it_pays(monkeypatch):
    splits = kvlab.model.weights.splits_columns
    monkeypatch.setattr(kvlab.model.weights, "SPLIT_MIN_WEIGHTS", 64 * 64)
    rows, big = torch.randn(4, 64), torch.randn(64, 64)
    assert splits(rows, big, 2) and splits(torch.randn(2, 2, 64), big, 4) and splits(torch.randn(64, 64), big, 2)
    assert not splits(rows, torch.randn(64, 63), 2)  # columns not divisible by the threads
    assert not splits(rows, torch.randn(32, 64), 2)  # below the size where the second thread pays
    assert splits(torch.randn(2, 64), big, 2) and not splits(torch.randn(1, 1, 64), big, 2)  # one row: MKL's gemv
    assert not splits(torch.randn(65, 64), big, 2)  # a prefill: MKL threads it itself
    assert not splits(rows.bfloat16(), big.bfloat16(), 2)  # half precision was not measured
    assert not splits(torch.randn(4, 32), big, 2) and not splits(rows, big[0], 2)  # malformed: x @ w's own error


def test_batched_step_at_two_threads_runs_the_column_blocks_and_matches_one_thread(monkeypatch, threads):
    cfg = tiny_config(d_model=128, d_ff=256, vocab_size=512)
    model = Decoder(cfg, device="cpu", seed=0)
    tokens = torch.randint(0, 512, (4, 9), generator=torch.Generator().manual_seed(1))  # a batch of 4: split
    calls = []
    blocks = kvlab.model.weights.column_blocks_matmul
    monkeypatch.setattr(kvlab.model.weights, "SPLIT_MIN_WEIGHTS", 128 * 128)
    monkeypatch.setattr(kvlab.model.weights, "column_blocks_matmul", lambda *a: calls.append(a[2]) or blocks(*a))
    logits = {}
    for n in (1, 2):
        threads(n)
        cache = model.new_cache(4, 16)
        model.prefill(tokens[:, :-1], cache)
        logits[n] = model.decode_step(tokens[:, -1], cache)
    assert calls and set(calls) == {2}  # only at two threads, and for the large weights
    assert_close(logits[2], logits[1], rtol=1e-5, atol=1e-5)


on_openblas = pytest.mark.skipif(
    kvlab.model.weights.numpy_openblas() is None,
    reason="one-row products run on numpy's OpenBLAS only where torch runs MKL on an AMD CPU and numpy has OpenBLAS",
)


@on_openblas
def test_openblas_row_is_the_plain_product_and_puts_openblas_threads_back(monkeypatch):
    blas = kvlab.model.weights.numpy_openblas()
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(96, 200, generator=gen))  # a parameter: it requires grad
    held, dot = [], kvlab.model.weights.np.dot
    monkeypatch.setattr(kvlab.model.weights.np, "dot", lambda *a: held.append(blas.get_num_threads()) or dot(*a))
    before = blas.get_num_threads()
    blas.set_num_threads(2)
    try:
        for x in (torch.randn(96, generator=gen), torch.randn(1, 96, generator=gen), torch.randn(1, 1, 96)):
            with torch.no_grad():
                out = kvlab.model.weights.openblas_row(x, w)
            assert out.shape == (*x.shape[:-1], 200)
            assert_close(out, x @ w.detach(), rtol=1e-5, atol=1e-5)
            assert blas.get_num_threads() == 2  # put back after the call
    finally:
        blas.set_num_threads(before)
    assert held == [1, 1, 1]  # one thread during each call

    # From another Python thread too (kvlab serve steps on one), though this thread set OpenBLAS's count last:
    # threadpoolctl 3.8 ignores the others' settings until the setter lets go.
    held.clear()
    blas.set_num_threads(2)
    try:
        worker = threading.Thread(target=lambda: kvlab.model.weights.openblas_row(torch.randn(96), w.detach()))
        worker.start()
        worker.join()
        assert blas.get_num_threads() == 2
    finally:
        blas.set_num_threads(before)
    assert held == [1]


@on_openblas
def test_a_single_sequence_step_at_one_thread_runs_on_openblas_and_matches_torch(monkeypatch, threads):
    model = Decoder(tiny_config(d_model=128, d_ff=256, vocab_size=512), device="cpu", seed=0)
    tokens = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(1))
    rows = []
    row = kvlab.model.weights.openblas_row
    monkeypatch.setattr(kvlab.model.weights, "openblas_row", lambda x, w: rows.append(x.numel()) or row(x, w))

    def step(batch: int) -> torch.Tensor:
        cache = model.new_cache(batch, 16)
        with torch.inference_mode():
            model.prefill(tokens[:batch, :-1], cache)
            return model.decode_step(tokens[:batch, -1], cache)

    threads(1)
    ours = step(1)
    assert len(rows) == 4 * model.cfg.n_layers + 1 and set(rows) <= {128, 256}  # the step's products, not prefill's
    rows.clear()
    step(2)  # two rows: torch's product
    threads(2)
    step(1)  # two threads: torch's product
    assert rows == []
    threads(1)
    monkeypatch.setattr(kvlab.model.weights, "runs_on_openblas", lambda x, w: False)
    assert_close(ours, step(1), rtol=1e-5, atol=1e-5)


class _OneThreadBLAS:
    """Stands in for numpy's OpenBLAS as threadpoolctl controls it, already at one thread: so that the conditions on
    the OpenBLAS route are tested on every machine, not only where ``numpy_openblas()`` finds one."""

    def get_num_threads(self) -> int:
        return 1


def test_one_row_products_leave_torch_only_when_nothing_needs_torch(monkeypatch, threads):
    threads(1)
    monkeypatch.setattr(kvlab.model.weights, "numpy_openblas", _OneThreadBLAS)
    w, x = torch.nn.Parameter(torch.randn(64, 32)), torch.randn(1, 1, 64)
    on = kvlab.model.weights.runs_on_openblas
    with torch.inference_mode():
        assert on(x, w) and on(x[0, 0], w)  # one row, [1, 1, in] or [in]
        assert not on(torch.randn(2, 64), w)  # two rows
        assert not on(x, torch.randn(32, 64).T)  # a tied head's transposed view: not contiguous
        assert not on(x.double(), w.double()) and not on(x.bfloat16(), w.bfloat16())
        assert not on(torch.tensor(1.0), torch.randn(1, 32))  # a 0-d row: x @ w's own error
    with torch.no_grad():
        assert not on(x, w)  # outside inference mode a transform may be watching: torch's product
    assert not on(x, w)

    # A trace (an ONNX export runs inside a decode step, so under inference mode) must record torch's MatMul, not a
    # constant numpy computed while tracing.
    fmt, weight = WeightFormat("fp32"), w.detach()
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.trace is; onnx_step's exporter traces with it
        traced = torch.jit.trace(lambda row: fmt.matmul(row, weight), (x,))
        other = torch.randn(1, 1, 64)
        assert_close(traced(other), other @ weight, rtol=1e-5, atol=1e-5)


@pytest.fixture
def fresh_openblas_choice():
    kvlab.model.weights.numpy_openblas.cache_clear()
    yield
    kvlab.model.weights.numpy_openblas.cache_clear()


def test_numpy_openblas_is_numpys_own_and_only_where_it_was_measured_to_win(monkeypatch, fresh_openblas_choice):
    """Fake libraries, so that every branch runs on any machine: numpy's own OpenBLAS is picked among several, a lone
    one (a conda numpy's, named "openblas" or behind conda-forge's "blas" shim) is taken, and an Intel CPU, a torch
    without MKL, a numpy on another BLAS, a shim beside MKL, two candidates with neither numpy's, or no threadpoolctl
    keep torch's product."""
    import threadpoolctl

    weights = kvlab.model.weights
    site = Path(np.__file__).resolve().parent.parent

    def lib(internal_api: str, filepath: str, user_api: str = "blas") -> SimpleNamespace:
        return SimpleNamespace(internal_api=internal_api, user_api=user_api, filepath=filepath)

    own = lib("openblas", str(site / "numpy.libs" / "libscipy_openblas64_-1.so"))
    conda = lib("openblas", "/opt/conda/lib/libopenblasp-r0.3.so")
    scipy = lib("openblas", str(site / "scipy.libs" / "libscipy_openblas-2.so"))
    mkl = lib("mkl", "/opt/conda/lib/libmkl_rt.so.2")
    omp = lib("openmp", "/usr/lib/libgomp.so.1", user_api="openmp")

    def choice(libs, blas="scipy-openblas", vendor="AMD", mkl=True):
        weights.numpy_openblas.cache_clear()
        monkeypatch.setattr(threadpoolctl, "ThreadpoolController", lambda: SimpleNamespace(lib_controllers=libs))
        monkeypatch.setattr(weights, "cpu_vendor", lambda: vendor)
        monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: mkl)
        monkeypatch.setattr(np, "show_config", lambda mode: {"Build Dependencies": {"blas": {"name": blas}}})
        return weights.numpy_openblas()

    assert choice([omp, scipy, own]) is own
    assert choice([omp, conda], blas="openblas") is conda
    assert choice([omp, conda], blas="blas") is conda  # conda-forge's shim, with OpenBLAS behind it
    assert choice([mkl, conda], blas="blas") is None  # the shim may lead to MKL
    assert choice([conda, scipy]) is None  # two, neither inside numpy: not guessed
    assert choice([omp]) is None
    assert choice([own], blas="mkl-sdl") is None and choice([own], blas="accelerate") is None
    assert choice([own], vendor="Intel") is None and choice([own], vendor="other") is None
    assert choice([own], mkl=False) is None
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)  # not installed
    assert choice([own]) is None


@pytest.mark.parametrize(
    ("cpuinfo", "processor", "vendor"),
    [
        ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\n", "", "AMD"),
        ("processor\t: 0\nvendor_id\t: GenuineIntel\n", "", "Intel"),
        (None, "AMD64 Family 25 Model 80 Stepping 0, AuthenticAMD", "AMD"),  # Windows
        (None, "Intel64 Family 6 Model 154 Stepping 3, GenuineIntel", "Intel"),
        (None, "arm", "other"),
    ],
)
def test_cpu_vendor_reads_cpuinfo_else_the_processor_string(tmp_path, monkeypatch, cpuinfo, processor, vendor):
    import kvlab.machine.timing as timing

    path = tmp_path / "cpuinfo"
    if cpuinfo is not None:
        path.write_text(cpuinfo)
    monkeypatch.setattr(timing, "Path", lambda _: path)
    monkeypatch.setattr(timing.platform, "processor", lambda: processor)
    assert timing.cpu_vendor() == vendor
