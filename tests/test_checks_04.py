"""Lesson 04's checkers: right work passes silently, each likely wrong answer is told its fault, hidden checks keep
the expected value to themselves, and the measured check is judged on fabricated sweeps (no timing here)."""

from __future__ import annotations

import math
import statistics

import pytest

from autograde import hidden
from kvlab import checks, get_model, roofline
from kvlab.course import lesson04_batching
from kvlab.engine import Engine, Request, RequestResult, RunReport
from kvlab.metrics import fit_line, percentile
from kvlab.model.decoder import Decoder
from tests.helpers import assert_fails, assert_silent


# -- reference answers, written from the lesson's text -------------------------------------------------------------
def step_bytes(cfg, batch, context):
    return roofline.weight_bytes_read(cfg, batch=batch), batch * context * roofline.kv_bytes_per_token(cfg)


def throughput_latency(report):
    tpots = [r.tpot_ms for r in report.results if r.tpot_ms is not None]
    return {
        "output_tokens_per_s": sum(len(r.output_ids) for r in report.results) / report.duration_s,
        "p50_tpot_ms": percentile(tpots, 50),
        "p99_tpot_ms": percentile(tpots, 99),
    }


def max_batch_for_memory(cfg, memory_bytes, context, kv_dtype=None):
    free = memory_bytes - roofline.weight_bytes(cfg)
    return max(0, int(free // (context * roofline.kv_bytes_per_token(cfg, kv_dtype))))


def max_batch_in_pool(n_blocks, block_size, prompt_len):
    return n_blocks // math.ceil(prompt_len / block_size)


def allocation_waste(lengths, max_seq_len, block_size):
    used = sum(lengths)
    return 1 - used / (len(lengths) * max_seq_len), 1 - used / (block_size * sum(-(-n // block_size) for n in lengths))


RIGHT = [
    ("check_step_bytes", step_bytes),
    ("check_throughput_latency", throughput_latency),
    ("check_max_batch_for_memory", max_batch_for_memory),
    ("check_max_batch_in_pool", max_batch_in_pool),
    ("check_allocation_waste", allocation_waste),
]


@pytest.mark.parametrize(("name", "answer"), RIGHT, ids=[name for name, _ in RIGHT])
def test_right_answer_passes_public_and_hidden_silently(capsys, name, answer):
    assert_silent(capsys, getattr(checks, name), answer)
    assert_silent(capsys, getattr(hidden, name), answer)


def test_throughput_latency_on_an_engine_run(capsys):
    model = Decoder(get_model("cpu-tiny").replace(n_layers=1), seed=0)
    requests = [Request(list(range(1, 10 + i)), n) for i, n in enumerate((4, 1, 6, 3))]
    report = Engine(model, n_blocks=16, max_batch=2, clock="simulated", gpu="h100-sxm").run(requests)
    assert_silent(capsys, checks.check_throughput_latency, throughput_latency, [report])


# -- exercise 1 ----------------------------------------------------------------------------------------------------
def test_step_bytes_weights_per_sequence_fails():
    message = assert_fails(
        checks.check_step_bytes, lambda c, b, t: (b * step_bytes(c, b, t)[0], step_bytes(c, b, t)[1]), match="weight"
    )
    assert "once per sequence" in message and "shares" in message


def test_step_bytes_batch_1_weights_fail_on_the_mixture_of_experts():
    def batch_one(cfg, batch, context):
        return roofline.weight_bytes_read(cfg), step_bytes(cfg, batch, context)[1]

    # A dense model's weights differ only by embedding rows; a batch of 16 routes Mixtral to nearly every expert.
    assert roofline.weight_bytes_read(get_model("mixtral-8x7b"), batch=16) > 2 * roofline.weight_bytes_read(
        get_model("mixtral-8x7b")
    )
    message = assert_fails(checks.check_step_bytes, batch_one, match="pass batch=")
    assert "cpu-small" in message  # its untied input table is read one row per sequence: caught at the first case


def test_step_bytes_every_parameter_fails():
    message = assert_fails(
        checks.check_step_bytes, lambda c, b, t: (roofline.weight_bytes(c), step_bytes(c, b, t)[1]), match="every"
    )
    assert "weight_bytes_read" in message


def test_step_bytes_one_sequence_of_kv_fails():
    message = assert_fails(
        checks.check_step_bytes,
        lambda c, b, t: (step_bytes(c, b, t)[0], t * roofline.kv_bytes_per_token(c)),
        match="KV",
    )
    assert "every sequence in the batch reads its own" in message


def test_step_bytes_hidden_withholds_the_expected_value():
    cfg = get_model("cpu-small").replace(n_kv_heads=2, name="fresh")
    want = step_bytes(cfg, 8, 300)
    message = assert_fails(
        checks.check_step_bytes,
        lambda c, b, t: (8 * step_bytes(c, b, t)[0], step_bytes(c, b, t)[1]),
        cases=[(cfg, 8, 300)],
        reveal=False,
        match="fresh",
    )
    assert str(want[0]) not in message and "once per sequence" not in message and "expected value" not in message


def test_step_bytes_returns_two_numbers():
    assert_fails(checks.check_step_bytes, lambda c, b, t: sum(step_bytes(c, b, t)), match="a tuple")


# -- exercise 2 ----------------------------------------------------------------------------------------------------
CONTEXTS = [1024, 2048, 3072, 4096]


def lines(batch: int, slope_b_ms: float, intercept_b_ms: float) -> dict[int, list[float]]:
    """TPOTs exactly on two lines, batch 1's (0.5 µs per token over 3 ms) and batch ``batch``'s: no timing here."""
    return {
        1: [3.0 + 5e-4 * c for c in CONTEXTS],
        batch: [intercept_b_ms + slope_b_ms * c for c in CONTEXTS],
    }


def ratios(tpot_ms: dict[int, list[float]]) -> tuple[float, float]:
    one, many = (fit_line(CONTEXTS, tpot_ms[b]) for b in sorted(tpot_ms))
    return many.slope / one.slope, many.intercept / one.intercept


GOOD = lines(4, 2e-3, 5.0)  # kv_ratio 4, weight_ratio 5 / 3


def test_batch_ratios_right_answer(capsys):
    assert_silent(capsys, checks.check_batch_ratios, *ratios(GOOD), CONTEXTS, GOOD)


def test_batch_ratios_inconsistent_with_the_measurement_fail():
    kv, weights = ratios(GOOD)
    message = assert_fails(checks.check_batch_ratios, 1 / kv, weights, CONTEXTS, GOOD, match="kv_ratio")
    assert "divide batch B's by batch 1's" in message
    message = assert_fails(checks.check_batch_ratios, kv, kv, CONTEXTS, GOOD, match="weight_ratio")
    assert "slopes' ratio" in message


def test_batch_ratios_need_batch_1_and_one_other():
    assert_fails(checks.check_batch_ratios, 4.0, 1.5, CONTEXTS, {2: GOOD[1], 4: GOOD[4]}, match="batch 1")
    assert_fails(checks.check_batch_ratios, 4.0, 1.5, CONTEXTS, None, match="measures both batches")
    assert_fails(checks.check_batch_ratios, 4.0, 1.5, CONTEXTS[:3], GOOD, match="one per context")


@pytest.mark.parametrize(
    ("slope_b", "intercept_b", "unmet"),
    [
        (1e-2, 5.0, "outside"),  # the slope grew 20x
        (5e-4, 5.0, "no less than the slope"),  # the slope did not grow; the intercept grew 5/3
        (2e-3, 3.0 * 4, "no less than the slope"),  # weights read once per sequence: both grew B times
        (4 * 5e-4 * 1.76 / 4, 3.0 * 3.65, "opposite of the lesson"),  # the learner's run: kv 1.76, weights 3.65
    ],
    ids=["kv_ratio_20", "kv_ratio_1", "weights_per_sequence", "intercept_grew_more_than_slope"],
)
def test_batch_ratios_that_contradict_the_lesson_pass_on_arithmetic_and_say_not_seen(
    capsys, slope_b, intercept_b, unmet
):
    bent = lines(4, slope_b, intercept_b)
    checks.check_batch_ratios(*ratios(bent), CONTEXTS, bent)
    out, err = capsys.readouterr()
    assert err == ""
    assert "did not show" in out and "grade does not depend on it" in out and unmet in out
    assert not checks.batch_reading(CONTEXTS, bent).seen


def test_batch_reading_wants_straight_lines():
    crooked = lines(4, 2e-3, 5.0)
    crooked[4] = [crooked[4][0], crooked[4][1] + 3.0, crooked[4][2] - 3.0, crooked[4][3]]
    seen = checks.batch_reading(CONTEXTS, crooked)
    assert not seen.seen and "not straight" in str(seen)
    assert checks.batch_reading(CONTEXTS, GOOD).seen


@pytest.mark.parametrize("kv_over_b", [checks.KV_RATIO_SEEN[0] * 1.01, 1.0, checks.KV_RATIO_SEEN[1] * 0.99])
def test_batch_reading_sees_its_own_range(capsys, kv_over_b):
    tpot_ms = lines(4, 4 * 5e-4 * kv_over_b, 3.0 * 0.5 * 4)  # weight_ratio 2, under the slope's and 0.95 x 4
    assert checks.batch_reading(CONTEXTS, tpot_ms).seen
    assert_silent(capsys, checks.check_batch_ratios, *ratios(tpot_ms), CONTEXTS, tpot_ms)


# -- exercise 3 ----------------------------------------------------------------------------------------------------
def test_throughput_latency_counting_requests_fails():
    def per_request(report):
        return {**throughput_latency(report), "output_tokens_per_s": len(report.completed) / report.duration_s}

    assert_fails(checks.check_throughput_latency, per_request, match="requests per second")


def test_throughput_latency_itl_percentiles_fail():
    def from_itl(report):
        gaps = [g for r in report.results for g in r.itl_ms]
        return {**throughput_latency(report), "p99_tpot_ms": percentile(gaps, 99)}

    assert_fails(checks.check_throughput_latency, from_itl, match="one number per request")


def test_throughput_latency_keeping_none_is_reported_with_its_call():
    def keeps_none(report):
        return {**throughput_latency(report), "p50_tpot_ms": percentile([r.tpot_ms for r in report.results], 50)}

    assert_fails(checks.check_throughput_latency, keeps_none, match="raised TypeError")


def test_throughput_latency_wrong_keys_fail():
    assert_fails(checks.check_throughput_latency, lambda r: {"tokens_per_s": 1.0}, match="p50_tpot_ms")


def test_throughput_latency_hidden_runs_differ_from_the_public_ones():
    made_up = hidden.CASES["check_throughput_latency"][0]
    assert isinstance(made_up, RunReport) and any(isinstance(r, RequestResult) and r.error for r in made_up.results)
    message = assert_fails(
        hidden.check_throughput_latency,
        lambda r: {**throughput_latency(r), "p99_tpot_ms": throughput_latency(r)["p50_tpot_ms"]},
        match="p99_tpot_ms",
    )
    assert "hidden check does not reveal" in message


# -- exercise 4 ----------------------------------------------------------------------------------------------------
def test_max_batch_for_memory_subtracting_the_weights_read_fails():
    def read(cfg, memory, context, kv_dtype=None):
        free = memory - roofline.weight_bytes_read(cfg)
        return max(0, int(free // (context * roofline.kv_bytes_per_token(cfg, kv_dtype))))

    # Llama's untied input table is read one row per sequence but held whole; Mixtral holds every expert.
    assert_fails(checks.check_max_batch_for_memory, read, match="every weight")
    assert_fails(checks.check_max_batch_for_memory, read, cases=lesson04_batching._memory_cases()[2:3], match="mixtral")


def test_max_batch_for_memory_negative_when_the_weights_do_not_fit_fails():
    def negative(cfg, memory, context, kv_dtype=None):
        return int((memory - roofline.weight_bytes(cfg)) // (context * roofline.kv_bytes_per_token(cfg, kv_dtype)))

    assert_fails(checks.check_max_batch_for_memory, negative, match="llama-3.1-70b.*no sequence fits at all")


def test_max_batch_for_memory_ignoring_kv_dtype_fails():
    def bf16(cfg, memory, context, kv_dtype=None):
        return max_batch_for_memory(cfg, memory, context)

    assert_fails(checks.check_max_batch_for_memory, bf16, match="kv_dtype")


@pytest.mark.parametrize("rounding", [round, math.ceil])
def test_max_batch_for_memory_rounding_is_named_as_rounding(rounding):
    """Rounding to the nearest (or up) and subtracting the weights one step reads give one count for Llama 3.1 8B:
    the message must name the rounding, from a case where only the rounding gives that count."""

    def rounds(cfg, memory, context, kv_dtype=None):
        free = memory - roofline.weight_bytes(cfg)
        return max(0, rounding(free / (context * roofline.kv_bytes_per_token(cfg, kv_dtype))))

    message = assert_fails(checks.check_max_batch_for_memory, rounds, match=r"rounds up, or to the nearest")
    assert "one step reads" not in message and "every weight" not in message


def test_max_batch_for_memory_float_is_rejected():
    assert_fails(checks.check_max_batch_for_memory, lambda *a: float(max_batch_for_memory(*a)), match="int")


# -- exercise 5 ----------------------------------------------------------------------------------------------------
def test_max_batch_in_pool_counting_tokens_fails():
    assert_fails(checks.check_max_batch_in_pool, lambda n, bs, p: n * bs // p, match="whole blocks")


def test_max_batch_in_pool_reserving_the_output_token_fails():
    assert_fails(checks.check_max_batch_in_pool, lambda n, bs, p: n // math.ceil((p + 1) / bs), match="never stored")


@pytest.mark.parametrize("case", [*lesson04_batching._POOL_CASES, *hidden.CASES["check_max_batch_in_pool"]])
def test_the_engine_admits_what_the_formula_says(case):
    assert lesson04_batching._admitted_at_once(*case) == (max_batch_in_pool(*case), 0)


def test_max_batch_in_pool_hidden_withholds_the_expected_value():
    message = assert_fails(hidden.check_max_batch_in_pool, lambda n, bs, p: n * bs // p, match="max_batch_in_pool")
    assert "hidden check does not reveal" in message and "It counts tokens" not in message


# -- exercise 6 ----------------------------------------------------------------------------------------------------
def test_allocation_waste_fraction_used_fails():
    def used(lengths, max_seq_len, block_size):
        return tuple(1 - w for w in allocation_waste(lengths, max_seq_len, block_size))

    assert_fails(checks.check_allocation_waste, used, match="contiguous waste.*fraction used")


def test_allocation_waste_blocks_rounded_down_fails():
    def floor(lengths, max_seq_len, block_size):
        used = sum(lengths)
        return allocation_waste(lengths, max_seq_len, block_size)[0], 1 - used / (
            block_size * sum(n // block_size for n in lengths)
        )

    assert_fails(checks.check_allocation_waste, floor, match="paged waste.*Round each")


def test_allocation_waste_hidden_withholds_the_expected_value():
    message = assert_fails(
        hidden.check_allocation_waste, lambda *a: (0.5, allocation_waste(*a)[1]), match="contiguous waste"
    )
    assert "hidden check does not reveal" in message


def test_a_fractional_count_is_told_to_round_down():
    assert_fails(
        checks.check_max_batch_for_memory, lambda cfg, memory, context, kv_dtype=None: 3.0, match="rounded down"
    )
    assert_fails(checks.check_max_batch_in_pool, lambda n_blocks, block_size, prompt_len: 2.5, match="rounded down")


def test_throughput_latency_that_keeps_none_tpots_is_told_to_leave_them_out():
    def keeps_none(report):
        tpots = sorted(r.tpot_ms for r in report.results)
        return {"output_tokens_per_s": 0.0, "p50_tpot_ms": tpots[0], "p99_tpot_ms": tpots[-1]}

    assert_fails(checks.check_throughput_latency, keeps_none, match="leave those requests out")


def test_throughput_latency_with_exclusive_quantiles_is_named():
    def exclusive(report):
        tpots = [r.tpot_ms for r in report.results if r.tpot_ms is not None]
        q = statistics.quantiles(tpots, n=100)
        return {"output_tokens_per_s": report.output_tokens_per_s, "p50_tpot_ms": q[49], "p99_tpot_ms": q[98]}

    assert_fails(checks.check_throughput_latency, exclusive, match="exclusive")


def test_batch_reading_does_not_see_an_intercept_that_shrank():
    """A quick run at load 8: straight lines, the slope x5.9, the intercept extrapolated below zero (x-0.07)."""
    shrunk = lines(4, 4 * 5e-4 * 1.48, -0.07 * 3.0)
    seen = checks.batch_reading(CONTEXTS, shrunk)
    assert not seen.seen and "shrank" in str(seen)


def test_headline_gives_the_verdict_without_the_figures():
    """A measurement cell above an exercise prints the headline: the ratios the exercise asks for stay unprinted."""
    bent = lines(4, 4 * 5e-4 * 1.76 / 4, 3.0 * 3.65)
    for data, verdict in ((GOOD, "Readable"), (bent, "NOT READABLE")):
        seen = checks.batch_reading(CONTEXTS, data)
        kv_ratio = f"{fit_line(CONTEXTS, data[4]).slope / fit_line(CONTEXTS, data[1]).slope:.2f}"
        assert kv_ratio in str(seen) and kv_ratio not in seen.headline() and seen.headline().startswith(verdict)


def test_retake_measures_again_while_unreadable_and_stops_at_takes():
    """The measurement cell's retake: the batch lines measured again until readable, at most TAKES times."""
    bent = lines(4, 4 * 5e-4 * 1.76 / 4, 3.0 * 3.65)
    queue = [bent, bent, GOOD, GOOD]
    data, seen = checks.retake(lambda: queue.pop(0), lambda t: checks.batch_reading(CONTEXTS, t))
    assert data is GOOD and seen.seen and seen.takes == 3 and "measurement 3 of at most" in str(seen)
    calls = []
    data, seen = checks.retake(lambda: calls.append(1) or bent, lambda t: checks.batch_reading(CONTEXTS, t))
    assert len(calls) == checks.TAKES and not seen.seen and "NOT READABLE" in str(seen)
    with pytest.raises(ValueError, match="takes"):
        checks.retake(lambda: GOOD, lambda t: checks.batch_reading(CONTEXTS, t), takes=0)
