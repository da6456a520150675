"""The ``kvlab`` command: predict TPOT for a model on a GPU, measure this machine, list the presets.

    kvlab predict --model llama-3.1-70b --gpu h100-sxm --context 30000
    kvlab bench --preset cpu-small --contexts 2k,8k,16k,32k --json out.json --plot out.png
    kvlab report --model llama-3.1-70b --gpu h100-sxm --context 32k --batch 8 --out report/
    kvlab serve --model kvlab-tiny-stdlib --port 8000
    kvlab models | kvlab gpus

A bad argument prints one line naming it and the allowed values, and exits with status 2. Only ``bench``, ``serve``
and ``report --measure`` load torch: ``predict``, ``report``, ``models`` and ``gpus`` are arithmetic over the presets
(``kvlab.roofline``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from kvlab.roofline import (
    Prediction,
    SpeculativePrediction,
    Target,
    acceptance_from_rate,
    active_params,
    gb_text,
    kv_bytes_per_token,
    param_count,
    predict,
    predict_json,
    speculate,
)
from kvlab.spec.config import ModelConfig
from kvlab.spec.dtypes import BYTES_PER_ELEMENT, KV_DTYPES, canonical_dtype
from kvlab.spec.presets import (
    draft_of,
    draft_presets,
    get_gpu,
    get_model,
    gpu_presets,
    model_presets,
    params_verified,
    served_context,
)
from kvlab.spec.published import HARDWARE_CLASSES

TOKENS_PER_K = 1024
# The runtimes kvlab serve runs: its cache is paged, which runtime="numba" does not read.
SERVE_RUNTIMES = ("eager", "onnx", "onnx-packed")
DEFAULT_BENCH_CONTEXTS = "1k,4k,8k,16k"
# bench's options that only make sense against a server
ENDPOINT_FLAGS = (
    "--model",
    "--num-prompts",
    "--max-concurrency",
    "--request-rate",
    "--input-len",
    "--output-len",
    "--trace",
    "--endpoint-type",
    "--backend",
    "--tokenizer",
    "--ignore-eos",
    "--gpu",
    "--bandwidth",
    "--model-preset",
)


class UsageError(Exception):
    """A bad command-line value; the message names the argument and what is allowed."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_tokens(text: str, name: str = "--context") -> int:
    """``30000``, ``32k`` (= 32 x 1024), ``1.5k`` or ``1m`` (= 1024 x 1024, a "1M context") -> a positive token
    count."""
    raw = text.strip().lower()
    scale = {"k": TOKENS_PER_K, "m": TOKENS_PER_K**2}.get(raw[-1:], 1)
    try:
        value = float(raw[:-1] if scale > 1 else raw) * scale
    except ValueError:
        raise UsageError(
            f"{name}: {text!r} is not a token count; allowed: a positive integer like 30000, 32k or 1m"
        ) from None
    if value != int(value) or value < 1:
        raise UsageError(f"{name}: {text!r}; allowed: a positive whole number of tokens like 30000, 32k or 1m")
    return int(value)


def _dtype(text: str, name: str, allowed: tuple[str, ...] | None = None) -> str:
    try:
        return canonical_dtype(text, name, allowed)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _positive_float(text: str, name: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UsageError(f"{name}: {text!r}; allowed: a number > 0")
    return value


def _probability(text: str, name: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise UsageError(f"{name}: {text!r}; allowed: a probability in [0, 1], such as 0.7")
    return value


def _positive_int(text: str, name: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"{name}: {text!r}; allowed: an integer >= 1")
    return int(text)


def _count(text: str, name: str) -> int:
    if not text.isdigit():
        raise UsageError(f"{name}: {text!r}; allowed: an integer >= 0")
    return int(text)


def _load_config(args: argparse.Namespace) -> ModelConfig:
    if args.model:
        return _usage(get_model, args.model, "--model")
    try:
        return ModelConfig.from_hf_config(args.config)
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise UsageError(f"--config: {args.config}: {e}") from None


def _usage(lookup, name, field: str, *more):
    """``lookup(name, field, *more)``, its ``ValueError`` (which names ``field``) as the command line's error."""
    try:
        return lookup(name, field, *more)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _policy_note(p) -> str:
    notes = []
    if p.window is not None:
        notes.append(f"{p.sinks} sinks + {p.window:,} window")
    if p.shared_prefix:
        notes.append(f"{p.shared_prefix:,}-token prefix read once per batch")
    return f" ({'; '.join(notes)})" if notes else ""


def _dtypes_note(dtypes: dict[str, str]) -> str:
    """``fp8 (embeddings bf16)``: the dtype of most weights, then each component that differs."""
    base = dtypes.get("other", next(iter(dtypes.values())))
    differ = [f"{component} {dtype}" for component, dtype in dtypes.items() if dtype != base]
    return base + (f" ({', '.join(differ)})" if differ else "")


def _read_note(cfg: ModelConfig, p) -> str:
    notes = [f"{p.active_params / 1e9:,.2f}B parameters"]
    if cfg.moe is not None:
        m = cfg.moe
        shared = f" + {m.n_shared_experts} shared" if m.n_shared_experts else ""
        notes.append(f"{p.experts_read:,.1f} of {m.n_experts} routed experts{shared} per MoE layer at batch {p.batch}")
    if p.input_embedding == "rows" and not cfg.tie_embeddings:
        notes.append("one input-embedding row per sequence")
    return "; ".join(notes)


def resolve_target(args: argparse.Namespace) -> Target:
    """``--model``/``--config``, ``--gpu``/``--bandwidth`` and ``--hardware-class``, checked."""
    cfg = _load_config(args)
    if args.gpu:
        gpu = _usage(get_gpu, args.gpu, "--gpu")
        hardware = args.hardware_class or gpu.hardware_class
        return Target(cfg, gpu.bandwidth_gbps, f"{gpu.name} datasheet", gpu, gpu.memory_gb, hardware)
    return Target(cfg, _positive_float(args.bandwidth, "--bandwidth"), "given", None, None, args.hardware_class)


@contextmanager
def _spelled_as_flags() -> Iterator[None]:
    """The byte model names its argument in a ``ValueError``; the command line spells it as the flag."""
    try:
        yield
    except ValueError as e:
        field, _, rest = str(e).partition(": ")
        raise UsageError(f"--{field.replace('_', '-')}: {rest}") from None


def run_predict(cfg: ModelConfig, context: int, bandwidth: float, batch: int, **options) -> Prediction:
    """``kvlab.roofline.predict``, with the byte model's field names spelled as the command line's flags."""
    with _spelled_as_flags():
        return predict(cfg, context, bandwidth, batch, **options)


def cmd_predict(args: argparse.Namespace) -> int:
    target = resolve_target(args)
    cfg, bandwidth, memory_gb, gpu = target.cfg, target.bandwidth_gbps, target.memory_gb, target.gpu
    context = parse_tokens(args.context)
    batch = _positive_int(args.batch, "--batch")
    wd = _dtype(args.weight_dtype, "--weight-dtype") if args.weight_dtype else None
    kd = _dtype(args.kv_dtype, "--kv-dtype", KV_DTYPES) if args.kv_dtype else None
    window = parse_tokens(args.window, "--window") if args.window else None
    sinks = _count(args.sinks, "--sinks")
    shared = parse_tokens(args.shared_prefix, "--shared-prefix") if args.shared_prefix else 0
    group = _positive_int(args.group_size, "--group-size") if args.group_size else None
    wgroup = _positive_int(args.weight_group_size, "--weight-group-size") if args.weight_group_size else None
    p = run_predict(
        cfg,
        context,
        bandwidth,
        batch,
        weight_dtype=wd,
        kv_dtype=kd,
        window=window,
        sinks=sinks,
        shared_prefix=shared,
        group_size=group,
        weight_group_size=wgroup,
        input_embedding=args.input_embedding,
        hardware_class=target.hardware_class,
    )
    memory_needed = p.weight_bytes + p.kv_bytes
    spec = _speculation(args, cfg, p)
    if args.json:
        print(json.dumps(predict_json(cfg, p, spec, memory_gb), indent=2))
        return 0
    dtypes = _dtypes_note(p.weight_dtypes) + (f", {p.weight_group_size}-weight groups" if p.weight_group_size else "")
    moe = f", {cfg.moe.top_k} of {cfg.moe.n_experts} experts per token" if cfg.moe else ""
    lo, hi = p.tpot_ms_range
    rows = [
        ("model", f"{cfg.name} ({cfg.attention_kind}, {cfg.n_layers} layers{moe})"),
        ("weights", f"{gb_text(p.weight_bytes)}, all parameters, in {dtypes}"),
        ("weights read", f"{gb_text(p.weight_bytes_read)} ({_read_note(cfg, p)})"),
        (
            "KV per token",
            f"{p.kv_bytes_per_token:,} B = {p.kv_bytes_per_token / 1024:,.1f} KiB in {p.kv_dtype}"
            + (f" ({p.kv_scales})" if p.kv_scales else ""),
        ),
        (f"KV read, {context:,} tok x {batch}", gb_text(p.kv_bytes) + _policy_note(p)),
        ("bytes per step", gb_text(p.bytes_per_step)),
        ("bandwidth", f"{bandwidth:,.0f} GB/s ({target.bandwidth_source})"),
        ("TPOT", f"{p.tpot_ms:,.2f} ms at full bandwidth (weights alone {p.tpot_ms_weights_only:,.2f} ms)"),
        ("TPOT, real systems", f"{lo:,.2f}-{hi:,.2f} ms: {p.tpot_ms_range_basis}"),
    ]
    if spec is not None:
        if args.draft_model:
            drafter = f"draft {args.draft_model}, {gb_text(spec.draft_bytes_per_step)} per step"
        elif args.draft_fraction:
            drafter = f"a draft reading {args.draft_fraction} of the plain step, {gb_text(spec.draft_bytes_per_step)}"
        else:
            drafter = "a drafter that reads no bytes (prompt lookup)"
        given = (
            f" (from accepted/drafted {args.acceptance_rate} at k={spec.k})" if args.acceptance_rate is not None else ""
        )
        rows += [
            (
                "speculation",
                f"k={spec.k} drafts at per-position acceptance a = {spec.acceptance:.3g}{given}: "
                f"{spec.tokens_per_step:.2f} tokens "
                f"per verify step; {drafter}",
            ),
            (
                "verify step",
                f"{gb_text(spec.verify_bytes_per_step)}: the weights {spec.k + 1} positions in each of {p.batch} "
                "sequences use"
                + (" (more experts than a plain step)" if cfg.moe is not None and spec.k else "")
                + f", and the KV at {p.context + spec.k:,} tokens",
            ),
            (
                "TPOT, speculative",
                f"{spec.tpot_ms:,.2f} ms per token at full bandwidth ({spec.speedup:.2f}x fewer bytes per token)",
            ),
        ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    if memory_gb is not None and memory_needed > memory_gb * 1e9:
        print(f"note: weights + KV need {gb_text(memory_needed)}, more than one {gpu.name}'s {memory_gb:g} GB")
    if cfg.weight_dtypes and wd is None:
        print("note: weights counted in the dtypes the checkpoint ships in; --weight-dtype overrides them all")
    if {"int8", "int4"} & set(p.weight_dtypes.values()) and p.weight_group_size is None:
        print("note: int weights counted without scales; pass --weight-group-size G for group-quantized weights")
    if cfg.moe is not None:
        print("note: experts read assume uniform routing (an upper end: real routers favour some experts)")
    if p.kv_dtype in ("fp8", "int8", "int4") and p.group_size is None:
        print(
            "note: KV payload only, one scale per tensor; pass --group-size G for a scale per G elements "
            "(kvlab's codecs: --group-size 32)"
        )
    served = served_context(cfg.name) if args.model else None
    if served is not None and context > served:
        print(f"note: {cfg.name}'s makers document serving {served:,} tokens; its config allows {cfg.max_seq_len:,}")
    if args.model and not params_verified(cfg.name):
        print(f"note: {cfg.name}'s parameter count is not verified; weights are counted from its shape")
    if cfg.layer_windows and any(w is not None for w in cfg.layer_windows):
        print("note: local (sliding-window) layers read at most their window; KV read accounts for that")
    return 0


def _speculation(args: argparse.Namespace, cfg: ModelConfig, p: Prediction) -> SpeculativePrediction | None:
    """``--speculate K`` with ``--acceptance A`` or ``--acceptance-rate R``, and ``--draft-model NAME`` or
    ``--draft-fraction F``: bytes per token of speculative decoding, or None."""
    given = [
        flag
        for flag, value in (
            ("--acceptance", args.acceptance),
            ("--acceptance-rate", args.acceptance_rate),
            ("--draft-model", args.draft_model),
            ("--draft-fraction", args.draft_fraction),
        )
        if value is not None
    ]
    if args.speculate is None:
        if given:
            raise UsageError(f"{'/'.join(given)}: they need --speculate K (drafts per verify step)")
        return None
    k = _count(args.speculate, "--speculate")
    if (args.acceptance is None) == (args.acceptance_rate is None):
        raise UsageError(
            "--acceptance, --acceptance-rate: give exactly one; allowed: --acceptance A (the probability a in [0, 1] "
            "that a draft is kept given the ones before it were) or --acceptance-rate R (accepted / drafted tokens "
            "at this k, in [0, 1], as vLLM's metrics report it)"
        )
    if args.acceptance is not None:
        acceptance = _probability(args.acceptance, "--acceptance")
    else:
        rate = _probability(args.acceptance_rate, "--acceptance-rate")
        if k < 1:
            raise UsageError("--acceptance-rate: needs --speculate K >= 1 (a rate of drafts needs drafts)")
        acceptance = acceptance_from_rate(rate, k)
    if args.draft_model and args.draft_fraction:
        raise UsageError("--draft-model, --draft-fraction: give one (what the draft reads), not both")
    draft_cfg = _usage(get_model, args.draft_model, "--draft-model") if args.draft_model else None
    fraction = _probability(args.draft_fraction, "--draft-fraction") if args.draft_fraction else None
    try:
        return speculate(cfg, p, k, acceptance, draft_cfg, fraction)
    except ValueError as e:
        raise UsageError(f"--draft-model: {e}") from None


def measure_sweep(
    preset: str,
    contexts: list[int],
    batch: int = 1,
    n_tokens: int = 16,
    n_requests: int = 3,
    fill: str = "fast",
    device: str | None = None,
    threads: int | None = None,
    runtime: str = "eager",
    weight_dtype: str = "fp32",
):
    """Decode the runnable ``preset`` on this machine at each context (tokens): ``kvlab bench``'s measurement, which
    ``kvlab report --measure`` runs too. Returns the config it ran (max context raised to fit) and the
    ``kvlab.measure.sweep.Sweep``, whose prediction uses the read bandwidth measured in the same run. ``runtime``
    is ``Decoder``'s (``"eager"``; ``"onnx"`` and ``"onnx-packed"`` for ONNX Runtime, ``"numba"`` for the step
    compiled by numba, both on the CPU), and so is
    ``weight_dtype`` (``kvlab.model.weights.WEIGHT_DTYPES``)."""
    import torch

    from kvlab.measure.sweep import sweep_context
    from kvlab.model.decoder import Decoder

    cfg = _usage(get_model, preset, "--preset")
    if not cfg.runnable:
        raise UsageError(f"--preset: {cfg.name} cannot run yet: {cfg.not_runnable_reason}")
    if threads:
        torch.set_num_threads(threads)
    capacity = max(contexts) + 64
    if capacity > cfg.max_seq_len:
        cfg = cfg.replace(max_seq_len=capacity)
    if runtime != "eager" and device is None:
        device = "cpu"  # the compiled runtimes run on the CPU: not CUDA, even where it is present
    _check_runtime(runtime, cfg, device, weight_dtype)
    device = _device(device)
    try:
        model = Decoder(cfg, device=device, weight_dtype=weight_dtype)
    except ValueError as e:
        if not str(e).startswith("weight_dtype: "):
            raise
        # A precision the device or the model cannot take, named by Decoder: the command line's error.
        raise UsageError(f"--weight-dtype: {str(e).removeprefix('weight_dtype: ')}") from None
    _set_runtime(model, runtime)
    sweep = sweep_context(model, contexts, n_tokens=n_tokens, n_requests=n_requests, batch=batch, fill=fill)
    return cfg, sweep


def _device(name: str | None):
    """``--device`` as a torch device (None: CUDA if present); a name torch does not know, or a GPU this machine
    lacks, is ``--device``'s error."""
    from kvlab.machine.device import resolve_device

    return _usage(resolve_device, name, "--device")


def _check_runtime(runtime: str, cfg: ModelConfig, device, weight_dtype: str = "fp32") -> None:
    """Refuse ``--runtime onnx``, ``onnx-packed`` or ``numba`` for a model it cannot run, in the command line's terms:
    before a model is built."""
    from kvlab.model.runtimes import RUNTIMES

    if runtime == "eager" or runtime not in RUNTIMES:  # an unknown name: the Decoder's refusal names them all
        return
    if weight_dtype != "fp32":
        raise UsageError(
            f"--weight-dtype: {weight_dtype} with --runtime {runtime}, which reads the fp32 parameters; allowed: "
            "--weight-dtype fp32, or --runtime eager"
        )
    if cfg.dtype != "fp32":
        fp32 = ", ".join(name for name, c in model_presets().items() if c.runnable and c.dtype == "fp32")
        raise UsageError(
            f"--runtime: {runtime} runs fp32 models, and {cfg.name} is {cfg.dtype}; allowed: --runtime eager, or an "
            f"fp32 model ({fp32})"
        )
    if str(device).split(":")[0] != "cpu":
        raise UsageError(
            f"--runtime: {runtime} runs on the CPU, and the model is on {device}; allowed: --device cpu, or --runtime "
            "eager"
        )


def _set_runtime(model, runtime: str) -> None:
    """``model.runtime = runtime``, with a refusal (an unknown name, a model it cannot run) as ``--runtime``'s."""
    _check_runtime(runtime, model.cfg, model.device, model.weight_dtype)
    try:
        model.runtime = runtime
    except ValueError as e:
        raise UsageError(f"--runtime: {str(e).removeprefix('runtime: ')}") from None


def _contexts(args: argparse.Namespace) -> list[int]:
    text = DEFAULT_BENCH_CONTEXTS if args.contexts is None else args.contexts
    given = [c.strip() for c in text.split(",") if c.strip()]
    if not given:
        raise UsageError(f"--contexts: {args.contexts!r} names no length; allowed: comma-separated, e.g. 2k,8k,16k")
    contexts: dict[int, str] = {}
    for text in given:
        tokens = parse_tokens(text, "--contexts")
        if tokens in contexts:
            # A sweep keeps one point per length, so a repeat would silently drop out of the fit.
            twice = (
                "is given twice" if text == contexts[tokens] else f"and {contexts[tokens]} are both {tokens:,} tokens"
            )
            raise UsageError(
                f"--contexts: {text} {twice}; allowed: distinct lengths (--requests measures one length more times)"
            )
        contexts[tokens] = text
    return list(contexts)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.endpoint:
        if args.runtime not in (None, "eager"):
            raise UsageError("--runtime: only without --endpoint (it picks what runs this machine's decode step)")
        if args.weight_dtype not in (None, "fp32"):
            raise UsageError("--weight-dtype: only without --endpoint (it picks how this machine's step reads weights)")
        return cmd_bench_endpoint(args)
    for flag in ENDPOINT_FLAGS:
        if getattr(args, flag.lstrip("-").replace("-", "_")) is not None:
            raise UsageError(f"{flag}: only with --endpoint URL (it measures a server, not this machine)")
    import torch

    from kvlab.model.onnx_step import one_graph_covers
    from kvlab.model.runtimes import ONNX_RUNTIMES
    from kvlab.model.weights import WEIGHT_DTYPES, numpy_openblas, weight_kernel

    contexts = _contexts(args)
    if args.fill not in ("fast", "prefill"):
        raise UsageError(f"--fill: {args.fill!r}; allowed: fast, prefill")
    threads = _positive_int(args.threads, "--threads") if args.threads else None
    batch = _positive_int(args.batch, "--batch")
    runtime = args.runtime or "eager"
    weight_dtype = _usage(canonical_dtype, args.weight_dtype or "fp32", "--weight-dtype", WEIGHT_DTYPES)
    cfg, sweep = measure_sweep(
        args.preset,
        contexts,
        batch,
        n_tokens=_positive_int(args.tokens, "--tokens"),
        n_requests=_positive_int(args.requests, "--requests"),
        fill=args.fill,
        device=args.device,
        threads=threads,
        runtime=runtime,
        weight_dtype=weight_dtype,
    )
    bw = sweep.bandwidth
    n_threads = torch.get_num_threads()
    engine = f"runtime {sweep.runtime}"
    if sweep.runtime in ONNX_RUNTIMES:
        engine += " (one graph a step)" if one_graph_covers(cfg) else " (two graphs a layer, attention between)"
    elif sweep.runtime == "numba":
        engine += " (one compiled call a step, on one thread)"
    elif weight_dtype != "fp32":
        engine += f", weights {weight_dtype} on {weight_kernel(weight_dtype, sweep.device)}"
    elif str(sweep.device) == "cpu" and n_threads == batch == 1 and cfg.dtype == "fp32" and numpy_openblas():
        engine += " (one-row products on numpy's OpenBLAS)"
    print(
        f"{cfg.name} ({cfg.dtype}) on {sweep.device}, batch {batch}, {n_threads} thread{'s' * (n_threads > 1)}, "
        f"{engine}; "
        f"measured copy {bw.copy_gbps:.1f} GB/s, read {bw.read_gbps:.1f} GB/s"
    )
    print(f"{'context':>8}  {'TPOT ms':>8}  {'p99 ms':>8}  {'predicted ms':>12}")
    for p in sweep.points:
        print(f"{p.context:>8}  {p.tpot_ms:>8.2f}  {p.metrics()['p99_tpot_ms']:>8.2f}  {p.predicted_tpot_ms:>12.2f}")
    s = sweep.summary()
    if len(sweep.points) < 2:
        print("one context: no line to fit; give --contexts two or more lengths for the slope and the intercept")
    else:
        print(
            f"fit: {s['slope_us_per_token']:.3f} us/token (predicted {s['predicted_slope_us_per_token']:.3f}), "
            f"intercept {s['intercept_ms']:.2f} ms (predicted {s['predicted_intercept_ms']:.2f}), "
            + _r_squared(len(sweep.points), s["r2"])
        )
        print(
            f"bandwidth each term reached, as a share of the {bw.read_gbps:.1f} GB/s read (predicted over fitted): "
            f"weight term (intercept) {_share(s['weight_bandwidth_fraction'])}, "
            f"KV term (slope) {_share(s['kv_bandwidth_fraction'])}"
        )
    if args.json:
        sweep.save_json(args.json)
    if args.plot:
        sweep.plot(args.plot)
    return 0


def _r_squared(n_points: int, r2: float) -> str:
    """The fit's R^2, with what it cannot tell: nothing through two points, and little below 0.9."""
    if n_points == 2:
        return "R^2 n/a (a line through two points fits them exactly)"
    return f"R^2 {r2:.4f}" + (" (below 0.9: the points are far from a line; add --requests)" if r2 < 0.9 else "")


def _share(fraction: float) -> str:
    """A share of bandwidth as a percentage; a fit with no positive term (time falling with context: noise, or too
    few contexts) has none to give, and a share above 1 says what can cause it."""
    if math.isnan(fraction):
        return "n/a (the fitted term is not positive: too noisy; add contexts or --requests)"
    if fraction > 1:
        # Not impossible: bytes that stay in the CPU's last-level cache are read faster than from memory.
        return f"{fraction:.0%} (above the read bandwidth: bytes served from a CPU cache, or a noisy fit)"
    return f"{fraction:.0%}"


def cmd_bench_endpoint(args: argparse.Namespace) -> int:
    """``kvlab bench --endpoint URL --model NAME``: vLLM's ``bench serve`` measurement of any OpenAI-compatible
    server, one run (``--input-len``, ``--trace``, or by default an input that fits the served context) or a sweep
    over ``--contexts``; with ``--gpu`` and ``--model-preset``, each context's median TPOT beside ``kvlab
    predict``'s."""
    from kvlab.serving.client import (
        BACKENDS,
        ENDPOINT_TYPES,
        EndpointError,
        RequestOptions,
        base_url,
        load_tokenizer,
        measure_prompt_tokens,
        random_prompts,
        read_trace,
        run_benchmark,
        sweep_contexts,
    )

    if not args.model:
        raise UsageError("--model: missing; allowed: the model name the server serves (GET /v1/models lists them)")
    url, url_type = base_url(args.endpoint)
    if args.endpoint_type is not None and args.endpoint_type not in ENDPOINT_TYPES:
        raise UsageError(f"--endpoint-type: {args.endpoint_type!r}; allowed: {', '.join(ENDPOINT_TYPES)}")
    if args.backend is not None and args.backend not in BACKENDS:
        raise UsageError(f"--backend: {args.backend!r}; allowed: {', '.join(BACKENDS)} (vLLM's names)")
    named = {t for t in (args.endpoint_type, BACKENDS.get(args.backend), url_type) if t}
    if len(named) > 1:
        raise UsageError(
            f"--endpoint-type, --backend, --endpoint: they name different endpoints ({', '.join(sorted(named))}); "
            "allowed: one endpoint type"
        )
    endpoint_type = named.pop() if named else "completions"
    n_prompts = _positive_int(args.num_prompts or "8", "--num-prompts")
    output_len = _positive_int(args.output_len or "64", "--output-len")
    concurrency = _positive_int(args.max_concurrency, "--max-concurrency") if args.max_concurrency else None
    rate = float("inf") if args.request_rate in (None, "inf") else _positive_float(args.request_rate, "--request-rate")
    if args.gpu and args.bandwidth:
        raise UsageError("--gpu, --bandwidth: give one (where the bandwidth comes from), not both")
    hardware = args.gpu or args.bandwidth
    if (hardware is None) != (args.model_preset is None):
        raise UsageError(
            "--model-preset: give it with --gpu NAME or --bandwidth GBPS (the model and the hardware the server runs), "
            "or none of them"
        )
    if args.trace and (args.input_len or args.contexts):
        raise UsageError(
            "--trace: its requests set their own lengths; allowed: --trace alone, or --input-len, or --contexts"
        )
    contexts = None if args.contexts is None else _contexts(args)  # before the server is asked anything
    try:
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
        request = RequestOptions(endpoint_type, bool(args.ignore_eos), tokenizer)
        facts = measure_prompt_tokens(url, args.model, request)
        options = {"max_concurrency": concurrency, "request_rate": rate, "options": request, "facts": facts}
        if contexts:
            facts.require_fit(contexts, output_len, "--contexts")
            results = sweep_contexts(url, args.model, contexts, n_prompts, output_len, **options)
        else:
            if args.trace:
                prompts = read_trace(args.trace, tokenizer)
            else:
                input_len = (
                    parse_tokens(args.input_len, "--input-len")
                    if args.input_len
                    else facts.default_input_len(output_len, exact=tokenizer is not None)
                )
                facts.require_fit([input_len], output_len, "--input-len")
                prompts = random_prompts(n_prompts, input_len, output_len, tokenizer=tokenizer)
            results = [run_benchmark(url, args.model, prompts, **options)]
    except ValueError as e:
        raise UsageError(str(e)) from None
    except EndpointError as e:
        print(f"kvlab bench: {url}: {e}", file=sys.stderr)
        return 1
    predicted = None
    if hardware:
        cfg = _usage(get_model, args.model_preset, "--model-preset")
        bandwidth = (
            _usage(get_gpu, args.gpu, "--gpu").bandwidth_gbps
            if args.gpu
            else _positive_float(args.bandwidth, "--bandwidth")
        )
        batch = min(concurrency or n_prompts, n_prompts)
        predicted = [
            run_predict(cfg, min(r["input_lens"][0] + output_len // 2, cfg.max_seq_len), bandwidth, batch)
            for r in results
        ]
    print(
        f"{url}{ENDPOINT_TYPES[endpoint_type]}, model {args.model}: "
        f"{n_prompts if not args.trace else 'trace'} requests per run, after one untimed warm-up request"
    )
    counted_by = {c for r in results for c in r["output_tokens_counted_by"]}
    for line in _endpoint_notes(facts.tokens_per_char, args.tokenizer, counted_by):
        print(line)
    header = (
        f"{'context':>8}  {'done':>5}  {'TTFT p50':>9}  {'TPOT p50':>9}  {'TPOT p99':>9}  {'ITL p50':>8}  {'tok/s':>7}"
    )
    print(header + ("  predicted TPOT" if predicted else ""))
    for i, r in enumerate(results):
        context = r.get("context", r["input_lens"][0] if r["input_lens"] else 0)
        if not r["completed"]:
            print(f"{context:>8}  {0:>5}  every request failed: {r['errors'][0]}")
            continue
        cell = {
            name: r.get(name, math.nan) for name in ("median_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms")
        }
        line = (
            f"{context:>8}  {r['completed']:>5}  {cell['median_ttft_ms']:>9.2f}  {cell['median_tpot_ms']:>9.2f}  "
            f"{cell['p99_tpot_ms']:>9.2f}  {cell['median_itl_ms']:>8.2f}  {r['output_throughput']:>7.1f}"
        )
        if predicted:
            line += f"  {predicted[i].tpot_ms:>8.2f} ms"
        print(line)
    if predicted:
        print(
            f"predicted: kvlab predict for {args.model_preset} at {predicted[0].bandwidth_gbps:,.0f} GB/s, the prompt "
            f"+ half the output, batch {predicted[0].batch} (bandwidth bound; real systems: "
            f"{predicted[0].tpot_ms_range_basis})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results[0] if len(results) == 1 else results, f, indent=2)
    return 0 if any(r["completed"] for r in results) else 1  # a run where nothing completed measured nothing


def _endpoint_notes(tokens_per_char: float | None, tokenizer: str | None, counted_by: set[str]) -> list[str]:
    """What ``kvlab bench --endpoint`` could and could not count exactly, in words, for stdout. ``tokens_per_char``:
    the server's, as its probe requests measured them (``None``: it reported no usage)."""
    if tokenizer:
        prompts = f"prompts: words, exactly --input-len tokens of {tokenizer}"
    elif tokens_per_char:
        prompts = (
            f"prompts: words, about --input-len tokens: {1 / tokens_per_char:.2f} characters per token, "
            "measured from the server's usage.prompt_tokens on two probe requests (--tokenizer makes it exact)"
        )
    else:
        prompts = (
            "prompts: words, about --input-len tokens at an assumed 4 characters per token (the server reported no "
            "usage; --tokenizer makes it exact)"
        )
    notes = [prompts + "; input lengths below are the server's usage.prompt_tokens where it reports them"]
    sources = {"usage": "the server's usage", "tokenizer": f"{tokenizer}'s count of the streamed text"}
    notes += [f"output tokens: counted by {sources[c]}" for c in sorted(counted_by - {"chunks"})]
    if "chunks" in counted_by:
        notes.append(
            "output tokens: COUNTED AS CHUNKS (the server sent no usage and no --tokenizer was given): each streamed "
            "chunk counts as one token, so TPOT is overstated where a chunk carries several"
        )
    return notes


def cmd_report(args: argparse.Namespace) -> int:
    from kvlab.report import DEFAULT_CONTEXT, build_report, summary_lines, write_report

    target = resolve_target(args)
    # The default is clipped to a shorter model's max context; a context the team gives is not.
    context = parse_tokens(args.context) if args.context else min(DEFAULT_CONTEXT, target.cfg.max_seq_len)
    batch = _positive_int(args.batch, "--batch")
    memory_gb = _positive_float(args.memory_gb, "--memory-gb") if args.memory_gb else None
    if context > target.cfg.max_seq_len:  # refused before the sweep below, which takes a while
        run_predict(target.cfg, context, target.bandwidth_gbps, batch)
    sweep = None
    if args.measure:
        # A short sweep: enough for a line and its fit on a laptop CPU in well under a minute.
        sweep = measure_sweep("cpu-small", [1024, 4096, 8192], n_tokens=8, n_requests=2)[1]
    with _spelled_as_flags():
        report = build_report(target, context, batch, memory_gb, sweep)
    try:
        written = write_report(report, args.out, sweep, images=not args.json_only)
    except OSError as e:
        raise UsageError(f"--out: {args.out}: {e.strerror}; allowed: a folder this user can create or write") from None
    for line in summary_lines(report):
        print(line)
    print(f"wrote {', '.join(str(p) for p in written)}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """``kvlab serve --model NAME``: the engine behind an OpenAI-compatible API (``kvlab.serving.server``)."""
    from kvlab.engine import Engine
    from kvlab.serving.server import Server, load_model, run_server

    port = _count(args.port, "--port")
    if port > 65535:
        raise UsageError(f"--port: {args.port}; allowed: 0 to 65535 (0: any free port)")
    kv_dtype = _dtype(args.kv_dtype, "--kv-dtype", ("fp8", "int8", "int4")) if args.kv_dtype else None
    window = parse_tokens(args.window, "--window") if args.window else None
    sinks = _count(args.sinks, "--sinks")
    if sinks and window is None:
        raise UsageError("--sinks: only with --window; allowed: --window W --sinks S (StreamingLLM: 1020 and 4)")
    block_size = _positive_int(args.block_size, "--block-size")
    max_batch = _positive_int(args.max_batch, "--max-batch")
    max_waiting = _positive_int(args.max_waiting, "--max-waiting")
    if args.runtime is not None and args.runtime not in SERVE_RUNTIMES:
        paged = args.runtime == "numba"
        why = "numba reads contiguous caches only, and kvlab serve's cache is paged; " if paged else ""
        raise UsageError(f"--runtime: {args.runtime!r}: {why}allowed: {', '.join(SERVE_RUNTIMES)}")
    device = _device(args.device)
    try:
        model, name, bos, eos = load_model(args.model, device)
    except (ValueError, OSError, RuntimeError) as e:
        raise UsageError(f"--model: {args.model}: {e}") from None
    if args.runtime:
        _set_runtime(model, args.runtime)
    # By default the pool holds max_batch requests at the model's full context.
    blocks = (
        _positive_int(args.blocks, "--blocks")
        if args.blocks
        else max_batch * math.ceil(model.cfg.max_seq_len / block_size)
    )
    engine = Engine(
        model,
        n_blocks=blocks,
        block_size=block_size,
        kv_dtype=kv_dtype,
        window=window,
        sinks=sinks,
        max_batch=max_batch,
        prefix_caching=not args.no_prefix_caching,
    )
    print(
        f"kvlab serve: {name} on http://{args.host}:{port} ({blocks} blocks of {block_size}, batch {max_batch}, "
        f"runtime {model.runtime})"
    )
    run_server(Server(engine, name, bos, max_waiting, eos), args.host, port)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    print(
        f"{'name':<16} {'dtype':<5} {'attention':<9} {'layers':>6} {'d_model':>7} {'heads':>5} {'kv':>4} {'params':>9} "
        f"{'active':>8} {'max ctx':>8} {'KV/token bf16':>14}  runnable"
    )
    presets = {**model_presets(), **draft_presets()}
    mixed = [name for name, c in presets.items() if c.weight_dtypes]
    for name, c in presets.items():
        kv = "-" if c.mla else c.n_kv_heads
        runnable = "yes" if c.runnable else "no: " + c.not_runnable_reason
        print(
            f"{name:<16} {c.dtype:<5} {c.attention_kind:<9} {c.n_layers:>6} {c.d_model:>7} {c.n_heads:>5} {kv:>4} "
            f"{param_count(c) / 1e9:>8.2f}B {active_params(c) / 1e9:>7.2f}B {c.max_seq_len:>8,} "
            f"{kv_bytes_per_token(c, 'bf16') / 1024:>10.1f} KiB  {runnable}"
        )
    print(
        f"dtype: what the model computes in and caches K/V in, as shipped; {', '.join(mixed)} ship some weights "
        "narrower (kvlab predict names them). kv: KV heads. KV/token: at bf16 for every model, so that rows compare "
        "(kvlab predict gives it in the model's dtype). "
        "active: parameters a batch-1 step reads (MoE: dense parts, shared and top-k routed experts), the input "
        "embedding counted whole; gpt-oss's published active counts leave it out, DeepSeek's 36.7B includes it "
        "(README_WEIGHTS.md; kvlab/data/reference_presets.md compares the counts)"
    )
    for name in draft_presets():
        print(f"{name}: a draft for {draft_of(name)} only (kvlab predict --draft-model {name})")
    return 0


def cmd_gpus(args: argparse.Namespace) -> int:
    print(f"{'name':<16} {'memory':>8} {'bandwidth':>11} {'bf16 dense':>12} {'fp8 dense':>12}")
    notes = []
    for g in gpu_presets().values():
        mark = ""
        if g.tflops_note:
            notes.append(f"{g.name}: {g.tflops_note}")
            mark = "*" * len(notes)
        bf16, fp8 = (("n/a" if t is None else f"{t:g} TF/s{mark}") for t in (g.bf16_tflops, g.fp8_tflops))
        print(f"{g.name:<16} {g.memory_gb:>5g} GB {g.bandwidth_gbps:>6,.0f} GB/s {bf16:>12} {fp8:>12}")
    for i, note in enumerate(notes, 1):
        print(f"{'*' * i} {note}")
    print(f"source: {next(iter(gpu_presets().values())).source}")
    return 0


def _add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and the bandwidth, as ``predict`` and ``report`` both take them (``resolve_target`` reads them)."""
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", help="a preset name (kvlab models)")
    model.add_argument("--config", help="a Hugging Face config.json (Llama-style keys)")
    bw = parser.add_mutually_exclusive_group(required=True)
    bw.add_argument("--gpu", help="a GPU preset (kvlab gpus): its bandwidth and memory")
    bw.add_argument("--bandwidth", help="memory bandwidth in GB/s")
    parser.add_argument(
        "--hardware-class",
        choices=HARDWARE_CLASSES,
        help="which published measurements the real-system TPOT range uses (default: the GPU preset's class; with "
        "--bandwidth, any class)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvlab", description=__doc__.split("\n")[0].replace("``", ""))
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("predict", help="bytes per decode step and predicted TPOT")
    _add_target_arguments(p)
    p.add_argument("--context", required=True, help="tokens each sequence attends over, e.g. 30000 or 32k")
    p.add_argument("--batch", default="1", help="sequences decoded together (default 1)")
    p.add_argument(
        "--weight-dtype",
        help=f"{', '.join(BYTES_PER_ELEMENT)} for every weight (default: what the checkpoint ships, per component)",
    )
    p.add_argument(
        "--weight-group-size",
        help="int8/int4 weights quantized in groups of G: each group adds a 16-bit scale and a 16-bit zero point "
        "(int4 g64 = 0.5625 B/weight, torchao; g32 = 0.625, gpt-fast; llama.cpp Q4_0 = int4 g64, Q8_0 = int8 g64). "
        "Omit for int8 with one scale per output channel",
    )
    p.add_argument(
        "--input-embedding",
        choices=("table", "rows"),
        default="table",
        help="charge an untied input embedding whole (table, the default, as most estimates do) or one row per "
        "sequence (rows: what a step reads)",
    )
    p.add_argument("--kv-dtype", help=f"{', '.join(KV_DTYPES)} (default: the model's)")
    p.add_argument("--window", help="keep only the W most recent tokens (plus --sinks); a step reads S + W")
    p.add_argument("--sinks", default="0", help="first tokens kept with --window (StreamingLLM's 4)")
    p.add_argument("--shared-prefix", help="tokens shared by the whole batch and read once per step")
    p.add_argument("--group-size", help="elements sharing one scale/zero point in a quantized KV cache")
    p.epilog = (
        "TPOT is the bandwidth bound: the bytes a step reads (MoE: the experts its batch routes to) over the "
        "bandwidth. 'real systems' divides it by the range of bandwidth fractions published decode measurements "
        "reached (kvlab/data/published_decode.csv). --context may not exceed the model's max context."
    )
    p.add_argument("--speculate", help="K drafted tokens per verify step: predict speculative decoding's TPOT")
    p.add_argument(
        "--acceptance",
        help="with --speculate: the per-position acceptance probability a in [0, 1], the chance that a draft is "
        "kept given the drafts before it were (not accepted/drafted: use --acceptance-rate for that)",
    )
    p.add_argument(
        "--acceptance-rate",
        help="with --speculate, instead of --acceptance: accepted / drafted tokens at this K, in [0, 1], as vLLM's "
        "spec-decode metrics report it; converted to a with the rule rate = (a + ... + a^K) / K",
    )
    p.add_argument(
        "--draft-model",
        help="with --speculate: the draft model's preset, sharing the target's vocabulary (default: a drafter "
        "reading no bytes, such as prompt lookup)",
    )
    p.add_argument(
        "--draft-fraction",
        help="with --speculate, instead of --draft-model: an assumed draft whose step reads this fraction of the "
        "target's plain step bytes, in [0, 1]",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_predict)

    b = sub.add_parser("bench", help="measure TPOT against context on this machine")
    b.add_argument("--preset", default="cpu-small", help="a runnable preset (default cpu-small)")
    b.add_argument("--contexts", help=f"comma-separated, e.g. 2k,8k,16k,32k (default {DEFAULT_BENCH_CONTEXTS})")
    b.add_argument("--batch", default="1", help="sequences decoded together (default 1)")
    b.add_argument("--tokens", default="16", help="output tokens per request (default 16)")
    b.add_argument("--requests", default="3", help="requests per context (default 3)")
    b.add_argument("--fill", default="fast", help="fast (random K/V) or prefill (default fast)")
    b.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if present)")
    b.add_argument("--threads", default=None, help="torch CPU threads (default: torch's choice)")
    b.add_argument(
        "--runtime",
        default=None,
        help="what runs the decode step: eager (PyTorch, the default), onnx (ONNX Runtime, one graph a step where "
        "the model allows, on --threads threads; CPU, fp32, MHA/GQA/MQA; pip install -e .[onnx]), or onnx-packed "
        "(onnx, its one graph holding a repacked copy of the weights: faster, more memory), or numba (the whole step "
        "as one call compiled by numba, on one thread, holding a transposed copy of the weights; CPU, fp32, "
        "MHA/GQA/MQA; pip install -e .[numba])",
    )
    b.add_argument(
        "--weight-dtype",
        default=None,
        help="the precision the step reads its weights in: fp32 (the default), bf16, fp16 or int8 (kvlab.model's "
        "weight_dtype); the header names the kernel that ran it",
    )
    b.add_argument("--json", help="write the results as JSON here")
    b.add_argument("--plot", help="write a measured-vs-predicted plot here (PNG)")
    server = b.add_argument_group("a server instead of this machine (vLLM's bench serve timing)")
    server.add_argument(
        "--endpoint", help="an OpenAI-compatible server's root URL or its /v1, e.g. http://127.0.0.1:8000/v1"
    )
    server.add_argument("--endpoint-type", help="completions (/v1/completions, the default) or chat")
    server.add_argument("--backend", help="vLLM's name for it: openai or vllm (completions), openai-chat (chat)")
    server.add_argument(
        "--tokenizer",
        help="a Hugging Face tokenizer name or folder: exact prompt lengths, and output counts where the server "
        "sends no usage",
    )
    server.add_argument(
        "--ignore-eos", action="store_true", default=None, help="ask the server to generate every --output-len token"
    )
    server.add_argument("--model", help="the model name the server serves")
    server.add_argument("--num-prompts", help="requests per run (default 8)")
    server.add_argument("--max-concurrency", help="requests in flight at most (default: all)")
    server.add_argument("--request-rate", help="Poisson arrivals per second (default inf: all at once)")
    server.add_argument(
        "--input-len",
        help="prompt tokens per request (default: vLLM's 1024, or less to fit the max_model_len /v1/models gives)",
    )
    server.add_argument("--output-len", help="tokens each request asks for (default 64)")
    server.add_argument("--trace", help="a JSON-lines file of {input_len, output_len} requests")
    server.add_argument("--gpu", help="with --model-preset: print kvlab predict's TPOT beside the measured one")
    server.add_argument("--bandwidth", help="instead of --gpu: the server's memory bandwidth in GB/s (kvlab bench)")
    server.add_argument("--model-preset", help="the preset of the model the server runs (kvlab models)")
    b.set_defaults(func=cmd_bench)

    r = sub.add_parser("report", help="a shareable report for one model, GPU, context and batch")
    _add_target_arguments(r)
    r.add_argument("--memory-gb", help="memory to fit weights + KV into, in GB (default: the GPU preset's)")
    r.add_argument(
        "--context", help="your tokens per sequence (default 32k, or the model's max context where that is shorter)"
    )
    r.add_argument("--batch", default="1", help="your sequences decoded together (default 1)")
    r.add_argument("--measure", action="store_true", help="also measure this machine (kvlab bench, cpu-small)")
    r.add_argument("--json-only", action="store_true", help="write report.json only (no plots, markdown, HTML)")
    r.add_argument("--out", required=True, help="folder for index.html, report.md, report.json and the plots")
    r.set_defaults(func=cmd_report)

    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (the batching engine)")
    s.add_argument("--model", required=True, help="a shipped checkpoint, a runnable preset, or a local HF folder")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", default="8000")
    s.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if present)")
    s.add_argument("--kv-dtype", help="fp8, int8 or int4 blocks (default: the model's dtype)")
    s.add_argument("--window", help="keep each request's W most recent tokens (plus --sinks), free the blocks between")
    s.add_argument("--sinks", default="0", help="first tokens kept with --window (StreamingLLM's 4)")
    s.add_argument("--no-prefix-caching", action="store_true", help="do not reuse cached prompt blocks")
    s.add_argument(
        "--runtime",
        help="what runs decode steps: eager (default) or onnx (ONNX Runtime, CPU, fp32; pip install -e .[onnx]); "
        "onnx-packed serves as onnx does (its paged cache runs two graphs a layer, which bind the weights); not "
        "numba, which reads contiguous caches only",
    )
    s.add_argument("--blocks", help="KV blocks in the pool (default: --max-batch requests at the full context)")
    s.add_argument("--block-size", default="16", help="tokens per block (default 16)")
    s.add_argument("--max-batch", default="8", help="requests decoded together at most (default 8)")
    s.add_argument("--max-waiting", default="64", help="requests waiting to be admitted before 429 (default 64)")
    s.set_defaults(func=cmd_serve)

    sub.add_parser("models", help="list model presets").set_defaults(func=cmd_models)
    sub.add_parser("gpus", help="list GPU presets").set_defaults(func=cmd_gpus)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
        # A short listing waits in stdout's buffer; flushing here, not at exit, lets a closed pipe land below.
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # A reader that stopped early (`kvlab models | head`): nothing left to say, and nobody to say it to.
        # Python flushes stdout at exit; onto the closed pipe that would raise again (Python's signal docs' recipe).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except UsageError as e:
        parser.exit(2, f"kvlab {args.command}: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
