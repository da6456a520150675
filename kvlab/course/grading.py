"""What every lesson's checkers share: quick mode, the lesson setup, calling the learner's function, comparing its
answer, wording the failure, and checking sweeps timed together and the ratios of their slopes. (Measuring again
until a timing is readable is ``kvlab.course.measured``'s.)

A wrong answer raises ``AssertionError`` whose message names the quantity, the form expected (units, an integer
number of bytes, ...) and what to fix. Exact arithmetic is compared exactly, against ``kvlab``'s own functions.
Measured quantities are never compared with one machine's timings: a checker asks instead whether an answer is
consistent with the learner's own measurements, and whether a ratio lies in a band wide enough for any machine
(each band says why it is that wide).

Every checker of a function takes ``cases`` (inputs to try) and ``reveal`` (whether a failure message may show
the expected value). The lessons call them with the defaults; the instructor's hidden checks call the same
checkers on fresh inputs with ``reveal=False``, so feedback never shows an expected value.
"""

from __future__ import annotations

import math
import numbers
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kvlab.measure.sweep import Sweep
from kvlab.spec.config import ModelConfig

REL_TOL = 1e-9  # floats computed by another order of operations differ in the last bits, never by more


# -- lesson support -------------------------------------------------------------------------------------------------
def quick_mode(env: Mapping[str, str] | None = None) -> bool:
    """The course's quick mode: ``KVLAB_QUICK`` set to anything but "" or "0", or run by nbgrader at all."""
    env = os.environ if env is None else env
    return env.get("KVLAB_QUICK", "0") not in ("", "0") or "NBGRADER_EXECUTION" in env


def setup_lesson(seed: int = 0) -> bool:
    """What every lesson's setup cell does; returns whether quick mode is on.

    - torch runs on one thread, unless ``OMP_NUM_THREADS`` asks for more outside quick mode: on shared cores a
      multi-threaded step waits for its slowest thread (measured in ``docs/cpu_performance.md``, section A, "One
      thread for the lessons"), and every prediction uses a bandwidth measured with the same threads.
    - Under nbgrader, warnings are silenced (a test cell that writes anything to stderr scores zero), and
      tracebacks shrink to their last line (a full one would quote the hidden test code into the feedback).
    - torch is seeded, so a notebook's random inputs repeat from run to run.
    """
    quick = quick_mode()
    if quick or "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    if "NBGRADER_EXECUTION" in os.environ:
        warnings.simplefilter("ignore")
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None:
            shell.run_line_magic("xmode", "Minimal")
    torch.manual_seed(seed)
    return quick


# -- message helpers ------------------------------------------------------------------------------------------------
Slips = Sequence[tuple[float, str]]  # (the value a slip produces, the slip named), for hint


def fail(quantity: str, got: Any, form: str, fix: str, expected: Any = None, reveal: bool = True) -> None:
    """Raise the learner's message: what they returned, what was wanted, and what to fix.

    Without ``expected``, ``form`` is what was wanted ("a dict with the key 'device'"). With it, ``form`` names
    the kind of value ("number of bytes"); a hidden check (``reveal=False``) then says only that the value is
    wrong, never which type to return, since the learner's type was already right.
    """
    if expected is None:
        want = f"expected {form}"
    elif reveal:
        want = f"expected {expected!r} ({form})"
    else:
        want = f"which is not the right {form} (a hidden check does not reveal the right one)"
    raise AssertionError(f"{quantity}: got {got!r}; {want}. {fix}")


# Factors of 1000 mean different slips in different units: a time in ms that is 1/1000 too small is in seconds,
# but a bandwidth 1/1000 too small comes from a time in ms divided into bytes, not from the bandwidth's GB.
_UNIT_SLIPS: dict[str, Slips] = {
    "ms": (
        (1e-3, "It is 1/1000 of the expected value: is it in seconds? Return milliseconds."),
        (1e3, "It is 1000 times the expected value: is the factor 1000 applied twice, or GB/s taken as 1e6 B/s?"),
    ),
    "µs": (
        (1e-3, "It is 1/1000 of the expected value: is it in ms? Return microseconds."),
        (1e3, "It is 1000 times the expected value: is the factor 1000 applied twice?"),
    ),
    "GB/s": (
        (1e-3, "It is 1/1000 of the expected value: are the times in ms where seconds belong?"),
        (1e3, "It is 1000 times the expected value: were the seconds divided by 1000?"),
        (1e9, "It is in bytes per second: divide by 1e9 for GB/s."),
    ),
}
_FACTOR_TWO: Slips = (
    (0.5, "It is half the expected value: is a factor of 2 missing?"),
    (2.0, "It is twice the expected value: is a factor of 2 counted twice?"),
)


def hint(got: float, want: float, reveal: bool, unit: str = "", slips: Slips = ()) -> str:
    """A sentence naming the slip that explains a wrong value, or "" when none does.

    ``slips`` pair a value that a checker recomputed with one named mistake (the query heads in place of the KV
    heads, say) with a sentence naming it, the likeliest first; they are tried first, since an exact match is
    better evidence than a ratio, which can have several causes. Then a factor of 2, and the factors of 1000 that
    ``unit`` makes likely. Nothing when ``reveal`` is off: a slip's value or a ratio would give the withheld value away.
    """
    if not reveal or not want or not is_real(got):
        return ""
    # Two slips can give one value (n_heads = 8 x n_kv_heads, and bits for bytes): name only the likeliest, since
    # a second, unrelated cause sends a learner who made the first one looking in the wrong place.
    named = next((slip for value, slip in slips if math.isclose(got, value, rel_tol=1e-9)), None)
    if named:
        return " " + named
    for ratio, slip in (*_FACTOR_TWO, *_UNIT_SLIPS.get(unit.split(" ")[0], ())):
        if math.isclose(got / want, ratio, rel_tol=1e-6):
            return " " + slip
    return ""


def is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


ROUND = "Return an int (round() a fractional count)."
FLOOR = "Return an int, rounded down (// or math.floor): only whole ones fit."


def exact_int(
    quantity: str, got: Any, want: int, unit: str, fix: str, reveal: bool, slips: Slips = (), to_int: str = ROUND
) -> None:
    """``got`` must be the int ``want``; ``to_int`` tells a learner who returned a float how to make it one."""
    if not is_int(got):
        kind = type(got).__name__
        fail(quantity, got, f"an int number of {unit}, not a {kind}", to_int)
    if got != want:
        fail(quantity, got, f"number of {unit}", fix + hint(got, want, reveal, unit, slips), want, reveal)


def exact_ints(trials: Sequence[tuple[str, Any, int, str, str, bool, Slips, str]]) -> None:
    """``exact_int`` over several cases of one exercise, each ``(quantity, got, want, unit, fix, reveal, slips,
    to_int)``, failing on the case that names the slip best.

    Two slips can give one value in one case and different values in another (rounding to the nearest and
    subtracting what a step reads both land one sequence above the right count, for some models). Where they agree,
    their value cannot tell which was made, so it names neither there; the failure is taken from the first case whose
    wrong value one slip alone explains, else from the first wrong case.
    """

    def clear(slips: Slips) -> Slips:
        return [(v, s) for v, s in slips if not any(math.isclose(v, w) and s != t for w, t in slips)]

    wrong = [t for t in trials if not (is_int(t[1]) and t[1] == t[2])]
    if not wrong:
        return
    mistyped = next((t for t in wrong if not is_int(t[1])), None)
    named = next((t for t in wrong if any(math.isclose(t[1], v) for v, _ in clear(t[6]))), None)
    quantity, got, want, unit, fix, reveal, slips, to_int = mistyped or named or wrong[0]
    exact_int(quantity, got, want, unit, fix, reveal, clear(slips), to_int)


def close_to(
    quantity: str,
    got: Any,
    want: float,
    unit: str,
    fix: str,
    reveal: bool,
    rel: float = REL_TOL,
    slips: Slips = (),
) -> None:
    if not is_real(got):
        fail(quantity, got, f"a number in {unit}, not a {type(got).__name__}", "Return a float.")
    if not math.isfinite(got):
        fail(quantity, got, f"a finite number in {unit}", "Look for a division by zero or an overflow.")
    if not math.isclose(got, want, rel_tol=rel, abs_tol=1e-12):
        fail(quantity, got, f"value in {unit}", fix + hint(got, want, reveal, unit, slips), want, reveal)


def call_learner(quantity: str, fn: Callable, *args: Any) -> Any:
    """Call the learner's function; an exception inside it is re-raised with the call that caused it."""
    try:
        return fn(*args)
    except NotImplementedError:
        raise AssertionError(f"{quantity}: not implemented yet; write the function body in the answer cell") from None
    except Exception as e:
        raise AssertionError(f"{quantity}: raised {type(e).__name__}: {e}") from e


def config_label(cfg: ModelConfig) -> str:
    return f"{cfg.name} ({cfg.attention_kind}, {cfg.n_layers} layers)"


def timed_together(sweeps: Mapping[str, Any], fix: str) -> None:
    """Each of ``sweeps`` (named as the learner knows it) is a ``kvlab.measure.Sweep``, all were timed against one
    ``Bandwidth`` measurement (the same object) and over the same contexts: a comparison of sweeps is fair only when
    they shared the machine's state, in one process. ``fix`` says what to pass instead of something not a Sweep."""
    for name, sweep in sweeps.items():
        if not isinstance(sweep, Sweep):
            fail(name, type(sweep).__name__, "a kvlab.measure.sweep.Sweep", fix)
    (first_name, first), *rest = sweeps.items()
    contexts = [p.context for p in first.points]
    for name, sweep in rest:
        if sweep.bandwidth is not first.bandwidth:
            fail(
                f"{name}.bandwidth",
                "another measurement",
                f"one Bandwidth object shared with {first_name}",
                "Time them interleaved, in this kernel, against one bandwidth measurement.",
            )
        if [p.context for p in sweep.points] != contexts:
            got = [p.context for p in sweep.points]
            fail(f"{name} contexts", got, f"{first_name}'s contexts {contexts}", "Sweep one list of contexts.")


def slopes_over(sweeps: Mapping[Any, Sweep], baseline: Any) -> dict[Any, float]:
    """``{key: sweeps[key]'s fitted slope / sweeps[baseline]'s}``, the baseline's own 1.0 included."""
    base = sweeps[baseline].fit.slope
    return {key: sweep.fit.slope / base for key, sweep in sweeps.items()}


def check_slope_ratios(
    name: str, got: Any, sweeps: Mapping[Any, Sweep], baseline: Any, fix: str, each: str, base: str
) -> None:
    """``got`` must be ``slopes_over(sweeps, baseline)`` (to 1e-6: the learner divides the same floats), a dict
    with every key of ``sweeps``. ``fix`` names the exercise; ``each`` and ``base`` name one sweep and the baseline
    as the lesson does ("layout", "MHA"). The slips named: the ratio inverted, the byte ratio (the prediction) and
    the intercepts' ratio. Whether the sweeps showed the lesson's effect is the lesson's ``*_reading``'s question."""
    if not isinstance(got, Mapping) or set(got) != set(sweeps):
        keys = list(got) if isinstance(got, Mapping) else type(got).__name__
        own = f"One ratio per {each}, {base}'s own (1.0) included."
        fail(name, keys, f"a dict with the sweeps' keys {list(sweeps)}", own)
    ref = sweeps[baseline]
    for key, ratio in slopes_over(sweeps, baseline).items():
        sweep = sweeps[key]
        slips = (
            (1 / ratio, f"It is inverted: the {each}'s slope over {base}'s, not {base}'s over the {each}'s."),
            (
                sweep.kv_bytes_per_token / ref.kv_bytes_per_token,
                "It is the byte ratio, the prediction: divide the measured slopes (sweep.fit.slope).",
            ),
            (
                sweep.fit.intercept / ref.fit.intercept,
                "It divides the intercepts: the slope (sweep.fit.slope) is what the KV bytes set.",
            ),
        )
        close_to(f"{name}[{key!r}]", got[key], ratio, "a ratio", fix, True, rel=1e-6, slips=slips)
