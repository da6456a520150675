"""Small shared builders for the tests: tiny model shapes that run in milliseconds, a greedy-token check that
holds on any CPU, the two ways a course checker is called (it passes silently, or fails saying what to fix), and
sweeps whose timings lie exactly on a line, for the measured checks, and a benchmark script loaded as a module."""

import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import pytest
import torch

from kvlab import Decoder, ModelConfig
from kvlab.machine import Bandwidth
from kvlab.measure import Sweep, SweepPoint
from kvlab.metrics import RequestTiming


def tiny_config(**overrides) -> ModelConfig:
    base = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96, vocab_size=101, max_seq_len=128)
    return ModelConfig(**(base | overrides))


def runtime_pair(cfg: ModelConfig, runtime: str, seed: int = 3) -> tuple[Decoder, Decoder]:
    """An eager model with random norm weights (at their initial ones, a step that skipped a norm would still match)
    and the same weights under ``runtime`` (a compiled one: ``"onnx"``, ``"onnx-packed"``, ``"numba"``)."""
    eager = Decoder(cfg, device="cpu", seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in eager.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
    other = Decoder(cfg, device="cpu", runtime=runtime)
    other.load_state_dict(eager.state_dict())
    return eager, other


@torch.inference_mode()
def first_step_logits(model: Decoder, token: int = 7) -> torch.Tensor:
    """``model``'s logits for ``token`` decoded into a fresh cache: one step at position 0."""
    return model.decode_step(torch.tensor([token]), model.new_cache(1, 8))


def sharp_random_model(vocab_size: int, seed: int = 0, **overrides) -> Decoder:
    """A small random model whose predictions depend strongly on context: every weight but the norms 10x the usual
    init, so greedy picks are far apart and a cache that loses context changes them."""
    base = dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=vocab_size, max_seq_len=256)
    m = Decoder(ModelConfig(**(base | overrides)), device="cpu", seed=seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(10)
    return m


def assert_greedy_picks(tokens: torch.Tensor, logits: torch.Tensor, rtol: float, atol: float) -> None:
    """Each id in ``tokens`` (``[..., N]``) is a greedy pick of ``logits`` (``[..., N, V]``), where ``logits`` come
    from another code path whose logits differ from those that chose ``tokens`` by at most ``atol + rtol * |x|``.

    Two such paths pick the same argmax wherever the top two logits are more than twice that apart; closer, either
    may win on a given CPU. So a token passes when its logit is within twice that of its row's maximum: the argmax
    itself, or a token tied with it to rounding. A wrong token (from a wrong mask, position or weight) sits far
    below the maximum and fails.
    """
    top = logits.amax(-1)
    shortfall = top - logits.gather(-1, tokens[..., None]).squeeze(-1)
    allowed = 2 * (atol + rtol * top.abs())
    bad = (shortfall > allowed).nonzero().tolist()
    assert not bad, (
        f"tokens at {bad} are not greedy picks: their logits are up to {shortfall.max().item():.3g} below their "
        f"rows' maximum, allowed {allowed.max().item():.3g}; tokens {tokens.tolist()}, "
        f"argmax {logits.argmax(-1).tolist()}"
    )


class Remeasure:
    """A measured check's ``remeasure``: each call returns ``value`` (what measuring again gave) and is counted."""

    def __init__(self, value) -> None:
        self.value, self.calls = value, 0

    def __call__(self):
        self.calls += 1
        return self.value


def assert_silent(capsys: pytest.CaptureFixture, check, *args, **kwargs) -> None:
    """``check(*args, **kwargs)`` passes and prints nothing (nbgrader zeroes a cell that writes to stderr)."""
    check(*args, **kwargs)
    out, err = capsys.readouterr()
    assert out == "" and err == "", f"{check.__name__} printed on success: {out!r} {err!r}"


def assert_fails(check, *args, match: str, **kwargs) -> str:
    """``check(*args, **kwargs)`` raises AssertionError matching ``match``; returns the message."""
    with pytest.raises(AssertionError, match=match) as info:
        check(*args, **kwargs)
    return str(info.value)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``kvlab *argv`` in this process: (exit status, stdout, stderr)."""
    from kvlab.cli import main

    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


# A machine's bandwidth as the measured checks' tests assume it: 10 GB/s read and copy, one thread.
BW = Bandwidth("cpu", 64.0, copy_gbps=10.0, read_gbps=10.0, copy_best_gbps=11.0, read_best_gbps=11.0, threads=1)


def fake_sweep(
    slope_us: float,
    kv_per_token: float = 8192.0,
    bandwidth: Bandwidth = BW,
    intercept_ms: float = 2.0,
    contexts: Sequence[int] = (512, 1024, 2048, 4096),
    step_bytes: Callable[[int], int] = lambda context: 0,
    weight_bytes: int = 0,
) -> Sweep:
    """A sweep whose TPOTs lie exactly on the line ``intercept_ms + slope_us x context``, so the measured checks run
    without timing anything: one request per context, two tokens one TPOT apart."""
    points = []
    for context in contexts:
        tpot = intercept_ms + slope_us * 1e-3 * context
        request = RequestTiming((tpot / 1e3, 2 * tpot / 1e3))
        points.append(SweepPoint(context, 1, [request], step_bytes(context), 0.0))
    return Sweep("fake", "cpu", 1, "fast", bandwidth, kv_per_token, weight_bytes, points)


def benchmark_module(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` loaded as the module ``name``: the scripts are not a package. It is registered in
    ``sys.modules`` before it runs, where a dataclass in it looks its module up."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
