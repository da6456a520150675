"""How a decode step multiplies by its weights: the precision they are read in, and the kernel that reads them.

Every projection of the model (QKV, output, SwiGLU's gate/up and down, the LM head) goes through
``WeightFormat.matmul(x, w)`` with ``w`` the fp32 parameter stored ``[in, out]``. The parameters stay the model's
state (checkpoints, training, Hugging Face export see only them); a format other than fp32 keeps a packed copy of
each one, rebuilt whenever the parameter changes (``Tensor._version``), so loading a checkpoint or editing a weight
in place needs no extra call. A write through ``.data`` or a numpy view bumps no version and is not seen: build the
model again after one.

- ``fp32``: ``x @ w``, torch's own kernel (MKL in torch's x86 wheels), with two exceptions measured on a 2-core
  AMD EPYC (Zen 3) (docs/cpu_performance.md, section K; ``benchmarks/weight_term.py``):
  - at one thread, on an AMD CPU, a one-row product (a single sequence's decode step) runs on numpy's OpenBLAS
    (``openblas_row``). On an idle machine MKL's one-row products read the weights at 15-17 GB/s, OpenBLAS's at
    17-21 and a sum of them at 22-27; in one process, taking turns, a step took 3-9% less time up to 2k tokens of
    context, and the same within 3% at 8k. Intel CPUs, where MKL is Intel's own, keep MKL: not measured.
  - at two threads or more, MKL ran a product of a few rows on one thread, so there a batched step's products
    (``SPLIT_ROWS``) cut a large weight's columns into one block per thread and run them as one batched product,
    which MKL spreads over the threads (``column_blocks_matmul``).
- ``int8``: symmetric, one fp32 scale per output channel, through PyTorch's dynamic quantized linear (fbgemm on
  x86, qnnpack on ARM): the activation row is quantized on the fly, the product runs in integers.
- ``fp16`` on an x86 CPU: fbgemm's fp16 product (``fbgemm_fp16``), the kernel behind PyTorch's dynamic fp16
  linear. It reads the weights as fp16, widens each register of them to fp32 as it streams (F16C, on every x86 CPU
  with AVX2) and multiplies in fp32, so the step reads half the bytes with no native fp16 dot product, and the
  activations keep fp32.
- ``bf16`` on a CPU with native bf16 dot products (AVX512-BF16, AMX): oneDNN's bf16 product on a weight reordered
  into its blocked layout once (``onednn_bf16``); the activation is cast to bf16 and the product back to fp32.
- Anywhere else (off the CPU, or a CPU with no kernel for the format): the weights stored in half precision, the
  activation cast to match, torch's own product, and the result cast back to fp32. On a CPU that is slower than
  fp32 (several times over without native half-precision dot products), so building such a format for the CPU
  warns.

On a 2-core AMD EPYC (Zen 4, AVX512-BF16), one pass over cpu-small's weights at one thread: fp32 10.2 ms, fp16 on
fbgemm 4.5-5.2, bf16 on the reordered weight 5.9-6.5 against 11.7-14.2 by torch's own bf16 product
(docs/cpu_performance.md, section M).
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kvlab.machine.timing import cpu_vendor
from kvlab.spec.config import ModelConfig

WEIGHT_DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp16", "int8")


def native_half(dtype: str) -> bool:
    """Whether this CPU has native dot products in ``dtype`` (``"bf16"`` or ``"fp16"``), as oneDNN detects them."""
    probe = {"bf16": torch.ops.mkldnn._is_mkldnn_bf16_supported, "fp16": torch.ops.mkldnn._is_mkldnn_fp16_supported}
    return bool(probe[dtype]())


@functools.cache
def fbgemm_fp16() -> bool:
    """Whether fbgemm's fp16 product runs on this CPU: a torch built with fbgemm, on an x86 CPU it supports (AVX2 and
    F16C). Asked of the kernel itself, once a process: a tiny weight packed and multiplied."""
    if not {"x86", "fbgemm"} & set(torch.backends.quantized.supported_engines):
        return False
    try:
        packed = _in_engine(("x86", "fbgemm"), lambda: torch.ops.quantized.linear_prepack_fp16(torch.ones(8, 8), None))
        torch.ops.quantized.linear_dynamic_fp16(torch.ones(1, 8), packed)
    except RuntimeError:  # fbgemm refuses a CPU without AVX2
        return False
    return True


@functools.cache
def onednn_bf16() -> bool:
    """Whether bf16 products run on oneDNN's kernel for a reordered weight: where the CPU has native bf16 dot
    products (``native_half``) and this torch has the kernel (PyTorch's compiler fuses linear layers with it). Asked
    of the kernel itself, once a process."""
    if not (torch.backends.mkldnn.is_available() and native_half("bf16")):
        return False
    try:
        packed = _pack_bf16(torch.ones(8, 8, dtype=torch.bfloat16))
        torch.ops.mkldnn._linear_pointwise(torch.ones(1, 8, dtype=torch.bfloat16), packed, None, "none", [], "")
    except (RuntimeError, AttributeError):  # a torch without the ops, or a oneDNN that refuses
        return False
    return True


def int8_weight_bytes(shape: tuple[int, int]) -> int:
    """Bytes an ``[in, out]`` weight takes as int8: one byte per weight plus one fp32 scale per output column."""
    n_in, n_out = shape
    return n_in * n_out + 4 * n_out


def projection_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """``[in, out]`` of every matrix a decode step multiplies by, in step order: per layer QKV, output, SwiGLU's
    gate/up and down, then the LM head (``[d_model, vocab]``, tied or not). MHA/GQA/MQA models only."""
    if cfg.mla is not None or cfg.moe is not None:
        raise ValueError(f"cfg: {cfg.name} has MLA or MoE; allowed: a dense model with MHA, GQA or MQA attention")
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    layer = [
        (cfg.d_model, q_dim + 2 * kv_dim),
        (q_dim, cfg.d_model),
        (cfg.d_model, 2 * cfg.d_ff),
        (cfg.d_ff, cfg.d_model),
    ]
    return layer * cfg.n_layers + [(cfg.d_model, cfg.vocab_size)]


def int8_step_weight_bytes(cfg: ModelConfig) -> int:
    """Bytes of weights an int8 decode step reads: every projection and the LM head, scales included."""
    return sum(int8_weight_bytes(shape) for shape in projection_shapes(cfg))


def weight_kernel(dtype: str, device: str | torch.device) -> str:
    """What runs the products of weights in ``dtype`` on ``device``: ``"fp32"`` (torch's product, or OpenBLAS's or
    column blocks, chosen per call), ``"int8"`` (PyTorch's dynamic quantized linear), ``"fbgemm-fp16"``,
    ``"onednn-bf16"``, or ``"cast"``: the activation cast to the weights' half precision and torch's own product (off
    the CPU, or on a CPU with no kernel for the format)."""
    on_cpu = torch.device(device).type == "cpu"
    if dtype in ("fp32", "int8"):
        return dtype
    if on_cpu and dtype == "fp16" and fbgemm_fp16():
        return "fbgemm-fp16"
    if on_cpu and dtype == "bf16" and onednn_bf16():
        return "onednn-bf16"
    return "cast"


class WeightFormat:
    """The precision a model's projections read their weights in, and the packed copies that precision needs."""

    def __init__(self, dtype: str = "fp32", device: str | torch.device = "cpu") -> None:
        if dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype: {dtype!r}; allowed: {', '.join(WEIGHT_DTYPES)}")
        if torch.device(device).type == "cpu" and weight_kernel(dtype, device) == "cast":
            warnings.warn(
                f"weight_dtype={dtype!r}: this CPU runs no kernel that reads {dtype} weights at memory speed "
                f"({_KERNEL_NEEDS[dtype]}), so every product runs torch's own {dtype} product and the step is slower "
                "than fp32, not faster (benchmarks/weight_precision.py measures it)",
                RuntimeWarning,
                stacklevel=3,
            )
        self.dtype = dtype
        self._packed: dict[tuple, tuple[int, weakref.ref, tuple[str, object]]] = {}

    def __getstate__(self) -> dict:
        # The packed copies are a cache of the weights, made again at first use (and their weak references do not
        # pickle): a copied or pickled model carries none.
        return {**self.__dict__, "_packed": {}}

    def matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in]`` times the fp32 weight ``w`` ``[in, out]`` -> ``[..., out]``, in this precision."""
        if self.dtype == "fp32":
            threads = torch.get_num_threads()
            if threads > 1 and splits_columns(x, w, threads):
                return column_blocks_matmul(x, w, threads)
            if threads == 1 and runs_on_openblas(x, w):
                return openblas_row(x, w)
            return x @ w
        # A packed format is for inference: its kernels carry no gradient.
        kernel, packed = self._pack(w)
        if kernel == "cast":
            return (x.to(packed.dtype) @ packed).to(x.dtype)
        rows = x.reshape(-1, x.shape[-1])
        if kernel == "int8":
            out = torch.ops.quantized.linear_dynamic(rows.float(), packed, True)
        elif kernel == "fbgemm-fp16":
            out = torch.ops.quantized.linear_dynamic_fp16(rows.float(), packed)
        else:
            out = torch.ops.mkldnn._linear_pointwise(rows.to(torch.bfloat16), packed, None, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1]).to(x.dtype)

    def kernel(self, w: torch.Tensor) -> str:
        """What runs this format's products by ``w``: ``weight_kernel`` of its precision on ``w``'s device."""
        return weight_kernel(self.dtype, w.device)

    def _pack(self, w: torch.Tensor) -> tuple[str, object]:
        """The kernel for ``w`` (``kernel``) and ``w``'s packed copy for it, rebuilt when ``w`` has changed since it
        was made (through an operation on it: a write through ``.data`` or a numpy view bumps no version and is not
        seen)."""
        # Keyed by memory, not identity: a tied head is a fresh ``embed.weight.T`` view at every step, and a view
        # shares its base's version counter. The entry also holds a weak reference to the tensor that owns the
        # memory, so a new weight allocated where a freed one was is not served the old one's copy; and the entry
        # goes when that tensor does.
        key = (w.data_ptr(), tuple(w.shape), tuple(w.stride()))
        owner = w if w._base is None else w._base
        # A tensor made under inference mode keeps no version counter; such a weight is packed once.
        version = -1 if w.is_inference() else w._version
        entry = self._packed.get(key)
        if entry is not None and entry[0] == version and entry[1]() is owner:
            return entry[2]
        kernel = self.kernel(w)
        if kernel == "int8":
            packed = _pack_int8(w)
        else:
            if self.dtype == "fp16":
                _check_fp16_range(w)
            half = w.detach().to(getattr(torch, _TORCH[self.dtype]))
            packed = _PACK_HALF[kernel](half) if kernel in _PACK_HALF else half
        entries = self._packed
        self._packed[key] = (version, weakref.ref(owner, lambda _, key=key: entries.pop(key, None)), (kernel, packed))
        return kernel, packed

    def weight_bytes(self, w: torch.Tensor) -> int:
        """Bytes a step reads for ``w`` ``[in, out]`` in this precision, scales included."""
        if self.dtype == "int8":
            return int8_weight_bytes(tuple(w.shape))
        return w.numel() * (4 if self.dtype == "fp32" else 2)


_TORCH = {"bf16": "bfloat16", "fp16": "float16"}
_KERNEL_NEEDS = {
    "bf16": "oneDNN's, which needs native bf16 dot products: AVX512-BF16 or AMX",
    "fp16": "fbgemm's, which needs an x86 CPU with AVX2",
}

# Where cutting a product into one block of columns per thread paid, measured on a 2-core AMD EPYC at two threads
# (docs/cpu_performance.md, section G): fp32 products of 2 to 64 rows by cpu-small's weights of 3-17 MB ran 7-35%
# faster; one row gained nothing that repeated runs agreed on (a bmm of one-row blocks does not spread either); on
# cpu-tiny, whose weights are all under 1 MB, splitting every product made the step slower. More than two threads,
# other CPUs and half-precision tensors were not measured: half precision keeps x @ w.
SPLIT_MIN_WEIGHTS = 1 << 19
SPLIT_ROWS = range(2, 65)


def splits_columns(x: torch.Tensor, w: torch.Tensor, threads: int) -> bool:
    """Whether ``WeightFormat.matmul`` runs ``x @ w`` as ``column_blocks_matmul`` at ``threads``: an fp32 CPU product
    of ``x`` ``[..., in]`` by ``w`` ``[in, out]`` whose row count lies in ``SPLIT_ROWS``, by a weight of
    ``SPLIT_MIN_WEIGHTS`` or more elements whose columns divide evenly. Anything else, malformed shapes included,
    keeps ``x @ w`` (and its error messages)."""
    return (
        w.device.type == "cpu"
        and x.dtype == w.dtype == torch.float32
        and w.dim() == 2
        and x.dim() >= 1
        and x.shape[-1] == w.shape[0]
        and w.numel() >= SPLIT_MIN_WEIGHTS
        and w.shape[1] % threads == 0
        and x.numel() // w.shape[0] in SPLIT_ROWS
    )


def column_blocks_matmul(x: torch.Tensor, w: torch.Tensor, blocks: int) -> torch.Tensor:
    """``x @ w`` (``[..., in]`` by ``[in, out]``) as one batched product over ``blocks`` column blocks of ``w``.

    MKL computes a product of a few rows on one thread, so at two threads a batched decode step streamed its weights
    at one core's bandwidth. The blocks are views (``w`` is not copied), and ``bmm`` hands each to its own thread.
    """
    rows = x.reshape(-1, x.shape[-1])
    parts = torch.bmm(rows.expand(blocks, *rows.shape), w.unflatten(1, (blocks, -1)).movedim(1, 0))
    return parts.transpose(0, 1).reshape(*x.shape[:-1], w.shape[1])


@functools.cache
def numpy_openblas() -> object | None:
    """numpy's OpenBLAS, as threadpoolctl controls it, where one-row fp32 products run on it; else ``None``.

    Only where torch's products run on MKL and the CPU is AMD's: that is where OpenBLAS was measured to win; and
    only where numpy's BLAS is OpenBLAS (a numpy on MKL or Accelerate, or no threadpoolctl, keeps torch's kernel).
    numpy's copy is the one inside numpy's installation (``numpy.libs``, ``numpy/.dylibs``), else the only OpenBLAS
    loaded. A conda-forge numpy names its BLAS only "blas" (a switchable shim): it counts as OpenBLAS when OpenBLAS is
    the only BLAS loaded. Decided once a process.
    """
    if not torch.backends.mkl.is_available() or cpu_vendor() != "AMD":
        return None
    try:
        blas_name = str(np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"]).lower()
    except (TypeError, KeyError):  # a numpy that does not say
        return None
    generic = blas_name in ("blas", "cblas")
    if "openblas" not in blas_name and not generic:
        return None
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return None
    with warnings.catch_warnings():
        # It warns (stderr, which zeroes a graded cell) of OpenMP runtimes loaded side by side; none is ours to fix.
        warnings.simplefilter("ignore")
        blas = [lib for lib in ThreadpoolController().lib_controllers if lib.user_api == "blas"]
    found = [lib for lib in blas if lib.internal_api == "openblas"]
    if generic and len(found) != len(blas):  # behind the shim may be MKL or BLIS
        return None
    site = Path(np.__file__).resolve().parent.parent
    own = [
        lib for lib in found if Path(lib.filepath).resolve().parent in (site / "numpy.libs", site / "numpy" / ".dylibs")
    ]
    if len(own) == 1:
        return own[0]
    return found[0] if len(found) == 1 else None


def runs_on_openblas(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``WeightFormat.matmul`` at one thread runs ``x @ w`` on numpy's OpenBLAS (``openblas_row``): one row
    ``x`` (``[..., in]``, one vector in all) by a contiguous fp32 CPU weight ``[in, out]``, where ``numpy_openblas()``
    found one. Only under inference mode (``decode_step`` and ``prefill`` run in it), where no gradient, forward
    derivative or functional transform is carried, and with no tracer or compiler watching (an ONNX export, traced
    inside a decode step, must record torch's MatMul): numpy is invisible to all of them."""
    return (
        x.dtype == w.dtype == torch.float32
        and x.dim() >= 1
        and w.dim() == 2
        and x.numel() == w.shape[0] == x.shape[-1]
        and w.device.type == "cpu"
        and w.is_contiguous()
        and torch.is_inference_mode_enabled()
        and not torch.jit.is_tracing()
        and not torch.compiler.is_compiling()
        and numpy_openblas() is not None
    )


def openblas_row(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` for one row ``x`` ``[..., in]`` by ``w`` ``[in, out]`` -> ``[..., out]``, on numpy's OpenBLAS held to
    one thread for the call (torch's count; its other threads would take a core torch was told to leave), then put
    back. ``x`` and ``w`` are shared with numpy, not copied."""
    blas = numpy_openblas()
    # threadpoolctl 3.8 lets only the Python thread that last set OpenBLAS's count set it again, and silently ignores
    # the others. The hold lasts one call, so take the count over from whichever thread has it, and let go after.
    let_go = getattr(blas, "clear_controlling_thread", None)
    threads = blas.get_num_threads()
    if threads != 1:
        if let_go is not None:
            let_go(force=True)
        blas.set_num_threads(1)
    try:
        # A [1, in] row, not a vector: numpy then takes the orientation of OpenBLAS's gemv that ran 3% faster here.
        out = np.dot(x.detach().numpy().reshape(1, -1), w.detach().numpy())
    finally:
        if threads != 1:
            blas.set_num_threads(threads)
            if let_go is not None:
                let_go()
    return torch.from_numpy(out).view(*x.shape[:-1], -1)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[in, out]`` -> int8 values ``[out, in]`` and one fp32 scale per output channel ``[out]``.

    Symmetric: a channel's largest magnitude maps to 127; an all-zero channel gets scale 1.
    """
    rows = w.detach().float().T
    scale = rows.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(rows / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def _in_engine(allowed: tuple[str, ...], pack: Callable[[], object]) -> object:
    """``pack()`` run under the first of ``allowed`` quantized engines this torch build has (a packing op dispatches
    on the engine in force), which is then put back."""
    engines = torch.backends.quantized.supported_engines
    engine = next((e for e in allowed if e in engines), None)
    if engine is None:
        raise RuntimeError(
            f"this torch build has no quantized engine for dynamic linear (has {engines}); "
            f"allowed engines: {', '.join(allowed)}"
        )
    with _ENGINE_LOCK:  # the engine is the process's: two threads packing at once would lose the caller's
        previous = torch.backends.quantized.engine
        try:
            torch.backends.quantized.engine = engine
            return pack()
        finally:
            torch.backends.quantized.engine = previous


_ENGINE_LOCK = threading.Lock()


def _pack_int8(w: torch.Tensor) -> object:
    q, scale = quantize_int8(w)

    def pack() -> object:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch marks quantized tensors deprecated (2.10+)
            qw = torch._make_per_channel_quantized_tensor(
                q, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0
            )
            return torch.ops.quantized.linear_prepack(qw, None)

    try:
        return _in_engine(("x86", "fbgemm", "qnnpack"), pack)
    except RuntimeError as e:
        raise RuntimeError(f"weight_dtype='int8': {e}") from None


FP16_MAX = 65504.0


def _check_fp16_range(w: torch.Tensor) -> None:
    """Refuse a weight fp16 cannot hold: a cast would make it inf (and the logits NaN), fbgemm would clamp it."""
    if w.device.type == "meta" or not w.numel():
        return
    largest = float(w.detach().abs().max())
    if not largest <= FP16_MAX:  # NaN too: fbgemm's packing would turn it into a finite number
        raise ValueError(
            f"weight_dtype='fp16': a weight of shape {tuple(w.shape)} holds {largest:g}, outside fp16's finite range "
            f"(+-{FP16_MAX:g}); allowed: finite weights within it, or weight_dtype 'fp32', 'bf16' or 'int8'"
        )


def _pack_fp16(half: torch.Tensor) -> object:
    """An fp16 weight ``[in, out]`` packed ``[out, in]`` for fbgemm's fp16 product (given in fp32, whose values are
    already fp16's: the packing rounds nothing)."""
    rows = half.T.float().contiguous()
    return _in_engine(("x86", "fbgemm"), lambda: torch.ops.quantized.linear_prepack_fp16(rows, None))


def _pack_bf16(half: torch.Tensor) -> torch.Tensor:
    """A bf16 weight ``[in, out]`` reordered into oneDNN's blocked layout for its bf16 product (``[out, in]`` in,
    laid out for one row at a time; products of more rows take it too)."""
    return torch.ops.mkldnn._reorder_linear_weight(half.T.contiguous(), 1)


_PACK_HALF = {"fbgemm-fp16": _pack_fp16, "onednn-bf16": _pack_bf16}
