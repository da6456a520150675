"""Lesson 06's checkers (GQA, MQA, MLA): a right answer passes silently, a likely wrong one fails with a message that
names the fix, hidden checks withhold the expected value, and the measured checks are tested on fabricated sweeps
(the remeasure replaced), so nothing here is timed."""

from __future__ import annotations

import dataclasses

import pytest

from autograde import hidden
from kvlab import checks, get_model, roofline
from kvlab.course import lesson06_gqa_mqa_mla as lesson06
from kvlab.machine.timing import Bandwidth
from kvlab.measure.sweep import Sweep
from kvlab.metrics import RequestTiming, fit_line
from kvlab.spec.config import MLAConfig
from tests import helpers
from tests.helpers import assert_fails, assert_silent

BW = helpers.BW


# -- reference answers, written the way a learner would -------------------------------------------------------------
def predict_layouts(cfg):
    size = roofline.kv_element_bytes(cfg.dtype)
    mha = 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * size
    out = {}
    for h in range(1, cfg.n_heads + 1):
        if cfg.n_heads % h == 0:
            n_bytes = 2 * cfg.n_layers * h * cfg.head_dim * size
            out[h] = (round(n_bytes), n_bytes / mha)
    return out


def split_slope(kv_heads, slopes_us):
    fit = fit_line(kv_heads, slopes_us)
    return fit.slope, fit.intercept


def mla_kv_bytes(cfg, size):
    m = cfg.mla
    latent = cfg.n_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * size
    return round(latent), round(
        cfg.n_layers * cfg.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * size
    )


def absorbed_intensity(cfg, size):
    m = cfg.mla
    return 2 * cfg.n_heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim) / ((m.kv_lora_rank + m.qk_rope_head_dim) * size)


def absorbed_step(cfg, context, batch):
    m = cfg.mla
    attention = cfg.n_layers * 2 * context * cfg.n_heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim)
    flops = batch * (2 * roofline.active_params(cfg) + attention)
    return flops, roofline.weight_bytes_read(cfg, batch=batch) + roofline.kv_bytes_per_step(cfg, context, batch)


def fake_sweep(slope_us: float, kv_per_token: float, bandwidth: Bandwidth = BW, intercept_ms: float = 2.0) -> Sweep:
    return helpers.fake_sweep(slope_us, kv_per_token, bandwidth, intercept_ms, contexts=(1024, 2048, 4096, 8192))


def layout_sweeps(slopes_us: dict[int, float], bandwidth: Bandwidth = BW) -> dict[int, Sweep]:
    """Fabricated sweeps of layouts of 8 query heads: {n_kv_heads: Sweep}, 1,024 B per KV head and token."""
    return {h: fake_sweep(slope, 1024.0 * h, bandwidth, intercept_ms=2.0 + 0.1 * h) for h, slope in slopes_us.items()}


PLAUSIBLE = {8: 2.4, 4: 2.2, 2: 1.5, 1: 1.1}  # µs per token: above each byte ratio, none steeper than MHA


def ratios_of(sweeps: dict[int, Sweep]) -> dict[int, float]:
    return {h: s.fit.slope / sweeps[8].fit.slope for h, s in sweeps.items()}


# -- right answers pass silently, public and hidden ------------------------------------------------------------------
FUNCTIONS = [
    (checks.check_predict_layouts, hidden.check_predict_layouts, predict_layouts),
    (checks.check_split_slope, hidden.check_split_slope, split_slope),
    (checks.check_mla_kv_bytes, hidden.check_mla_kv_bytes, mla_kv_bytes),
    (checks.check_absorbed_intensity, hidden.check_absorbed_intensity, absorbed_intensity),
    (checks.check_absorbed_step, hidden.check_absorbed_step, absorbed_step),
]


@pytest.mark.parametrize(("check", "hidden_check", "answer"), FUNCTIONS, ids=[c.__name__ for c, _, _ in FUNCTIONS])
def test_right_answer_passes_silently(capsys, check, hidden_check, answer):
    assert_silent(capsys, check, answer)
    assert_silent(capsys, hidden_check, answer)


def test_measured_right_answers_pass_silently(capsys):
    sweeps = layout_sweeps(PLAUSIBLE)
    assert_silent(capsys, checks.check_layout_ratios, ratios_of(sweeps), sweeps)
    assert_silent(capsys, checks.check_split_slope, split_slope, sweeps)
    one_head = fake_sweep(0.7, 1024.0)
    query_side = (sweeps[1].fit.slope - one_head.fit.slope) * 1e3 * 8 / 7
    assert_silent(capsys, checks.check_query_side, query_side, sweeps, one_head)
    naive, absorbed = fake_sweep(20.0, 640.0), fake_sweep(0.5, 640.0)
    assert_silent(capsys, checks.check_absorbed_share, absorbed.fit.slope / naive.fit.slope, naive, absorbed)


# -- exercise 1 ------------------------------------------------------------------------------------------------------
def test_predict_layouts_slips_are_named():
    def own_layout(cfg):
        return {h: (roofline.kv_bytes_per_token(cfg), r) for h, (_, r) in predict_layouts(cfg).items()}

    assert_fails(checks.check_predict_layouts, own_layout, match="config's own layout")

    def derived_head_dim(cfg):
        return predict_layouts(cfg.replace(head_dim=cfg.d_model // cfg.n_heads))

    assert_fails(checks.check_predict_layouts, derived_head_dim, match=r"head_dim as d_model / n_heads \(80\)")

    def inverted(cfg):
        return {h: (b, 1 / r) for h, (b, r) in predict_layouts(cfg).items()}

    assert_fails(checks.check_predict_layouts, inverted, match="inverted")

    def powers_of_two(cfg):
        return {h: v for h, v in predict_layouts(cfg).items() if h & (h - 1) == 0}

    assert_fails(checks.check_predict_layouts, powers_of_two, match="every divisor of n_heads=9")
    assert_fails(checks.check_predict_layouts, lambda cfg: [1, 2], match="Return a dict")


def test_predict_layouts_one_layer_and_bits():
    def one_layer(cfg):
        return predict_layouts(cfg.replace(n_layers=1))

    assert_fails(checks.check_predict_layouts, one_layer, match="one layer's bytes")

    def bits(cfg):
        # on the MHA entry only: on the others, 8 x the bytes can equal another layout's (cpu-small: 1 KV head x 8)
        return {h: (b * 8 if h == cfg.n_heads else b, r) for h, (b, r) in predict_layouts(cfg).items()}

    assert_fails(checks.check_predict_layouts, bits, match="bits per element")


def test_hidden_checks_withhold_the_expected_value():
    def off_by_one(cfg):
        return {h: (b + 1, r) for h, (b, r) in predict_layouts(cfg).items()}

    message = assert_fails(hidden.check_predict_layouts, off_by_one, match="does not reveal")
    assert str(predict_layouts(hidden._GQA)[1][0]) not in message  # the first hidden case's right count
    message = assert_fails(hidden.check_absorbed_intensity, lambda cfg, size: 1.0, match="does not reveal")
    assert f"{absorbed_intensity(hidden._MLA, 2)!r}" not in message
    # a slip's hint would give the value away too: none is named
    message = assert_fails(hidden.check_mla_kv_bytes, lambda cfg, size: (0, 0), match="does not reveal")
    assert "It " not in message.split("does not reveal")[1]


# -- exercise 2 ------------------------------------------------------------------------------------------------------
def test_layout_ratios_consistency_slips():
    sweeps = layout_sweeps(PLAUSIBLE)
    right = ratios_of(sweeps)
    assert_fails(checks.check_layout_ratios, {h: 1 / r for h, r in right.items()}, sweeps, match="inverted")
    assert_fails(checks.check_layout_ratios, {h: h / 8 for h in right}, sweeps, match="byte ratio, the prediction")
    assert_fails(checks.check_layout_ratios, {8: 1.0, 1: right[1]}, sweeps, match="One ratio per layout")


def test_layout_ratios_need_one_bandwidth_measurement():
    sweeps = layout_sweeps(PLAUSIBLE)
    other = Bandwidth("cpu", 64.0, 10.0, 10.0, 11.0, 11.0, threads=1)
    sweeps[1] = fake_sweep(PLAUSIBLE[1], 1024.0, other)
    assert_fails(checks.check_layout_ratios, ratios_of(sweeps), sweeps, match="one Bandwidth object")


def test_layout_ratios_need_one_list_of_contexts():
    sweeps = layout_sweeps(PLAUSIBLE)
    sweeps[1] = dataclasses.replace(sweeps[1], points=sweeps[1].points[:3])
    message = assert_fails(checks.check_layout_ratios, ratios_of(sweeps), sweeps, match=r"sweeps\[1\] contexts")
    assert "sweeps[8]'s contexts [1024, 2048, 4096, 8192]" in message and "Sweep one list of contexts" in message


def test_layout_ratios_name_divided_intercepts():
    sweeps = layout_sweeps(PLAUSIBLE)
    intercepts = {h: s.fit.intercept / sweeps[8].fit.intercept for h, s in sweeps.items()}
    assert_fails(checks.check_layout_ratios, intercepts, sweeps, match="divides the intercepts")


def not_seen_note(capsys) -> str:
    """What a check printed, which must be its plain note that the effect was not seen (stdout, never stderr)."""
    out, err = capsys.readouterr()
    assert err == "" and "did not show" in out and "grade does not depend on it" in out, (out, err)
    return out


@pytest.mark.parametrize(
    ("slopes", "unmet"),
    [
        ({8: 2.4, 4: 5.0, 2: 1.5, 1: 1.1}, "4 KV heads (2.08) not flatter than 8"),  # GQA-4 twice MHA
        ({8: 2.4, 4: 3.108, 2: 2.676, 1: 1.1}, "not flatter than 8"),  # the learner's run: GQA-4 1.295, GQA-2 1.115
        ({8: 2.4, 4: 2.2, 2: 1.2, 1: 1.6}, "1 KV heads (0.67) not flatter than 2"),  # MQA steeper than GQA-2
        ({8: 2.4, 4: 1.2, 2: 0.6, 1: 0.1}, "faster than the bytes allow"),  # MQA at 0.04 x MHA for 0.125 the bytes
    ],
    ids=["gqa4_twice_mha", "learner_gqa_above_mha", "mqa_above_gqa2", "beats_its_bytes"],
)
def test_layouts_that_contradict_the_lesson_pass_on_arithmetic_and_say_not_seen(capsys, slopes, unmet):
    sweeps = layout_sweeps(slopes)
    checks.check_layout_ratios(ratios_of(sweeps), sweeps)
    assert unmet in not_seen_note(capsys)
    assert not checks.layout_reading(sweeps).seen


def test_layout_reading_wants_straight_lines():
    sweeps = layout_sweeps(PLAUSIBLE)
    assert checks.layout_reading(sweeps).seen
    crooked = sweeps[4]
    crooked.points[1].requests[0] = RequestTiming((0.0, 0.05))  # one point 50 ms off its line
    seen = checks.layout_reading(sweeps)
    assert not seen.seen and "not straight" in str(seen)


# -- exercises 3 and 4 -----------------------------------------------------------------------------------------------
def test_split_slope_swapped_and_inconsistent():
    assert_fails(checks.check_split_slope, lambda x, y: split_slope(x, y)[::-1], match="return \\(a, b\\)")
    sweeps = layout_sweeps(PLAUSIBLE)

    def one_point_off(x, y):
        return split_slope(x, [*y[:-1], y[-1] + 0.5])

    assert_fails(checks.check_split_slope, one_point_off, sweeps, match="least-squares line")


def test_query_side_slips():
    sweeps = layout_sweeps(PLAUSIBLE)
    one_head = fake_sweep(0.7, 1024.0)
    difference = (sweeps[1].fit.slope - one_head.fit.slope) * 1e3
    assert_fails(checks.check_query_side, difference, sweeps, one_head, match="scale it to all 8")
    assert_fails(checks.check_query_side, difference / 7, sweeps, one_head, match="one query head's work")
    assert_fails(checks.check_query_side, difference * 8 / 7 / 1e3, sweeps, one_head, match="ms per token")
    elsewhere = fake_sweep(0.7, 1024.0, Bandwidth("cpu", 64.0, 10.0, 10.0, 11.0, 11.0, threads=1))
    assert_fails(checks.check_query_side, difference * 8 / 7, sweeps, elsewhere, match=r"shared with sweeps\[1\]")


# -- exercise 5 ------------------------------------------------------------------------------------------------------
def test_mla_kv_bytes_slips_are_named():
    def per_head(cfg, size):
        latent, mha = mla_kv_bytes(cfg, size)
        return latent * cfg.n_heads, mha

    assert_fails(checks.check_mla_kv_bytes, per_head, match="one latent per layer, shared")

    def k_and_v(cfg, size):
        m = cfg.mla
        return round(cfg.n_layers * (2 * m.kv_lora_rank + m.qk_rope_head_dim) * size), mla_kv_bytes(cfg, size)[1]

    assert_fails(checks.check_mla_kv_bytes, k_and_v, match="stores c_kv twice")

    def v_as_wide_as_k(cfg, size):
        return mla_kv_bytes(cfg, size)[0], round(2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * size)

    assert_fails(checks.check_mla_kv_bytes, v_as_wide_as_k, match="V is v_head_dim")

    def truncated(cfg, size):  # the second playtest's accepted slip: int() where the exercise says round
        m = cfg.mla
        latent = cfg.n_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * size
        return int(latent), int(
            cfg.n_layers * cfg.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * size
        )

    assert_fails(checks.check_mla_kv_bytes, truncated, match="truncates")


# -- exercise 6 ------------------------------------------------------------------------------------------------------
def test_absorbed_share_inverted_and_not_seen(capsys):
    naive, absorbed = fake_sweep(20.0, 640.0), fake_sweep(0.5, 640.0)
    assert_fails(checks.check_absorbed_share, 40.0, naive, absorbed, match="inverted")
    assert_silent(capsys, checks.check_absorbed_share, 0.025, naive, absorbed)
    flat_naive = fake_sweep(0.8, 640.0)  # the absorbed slope 0.625 of the naive: the effect not seen
    checks.check_absorbed_share(absorbed.fit.slope / flat_naive.fit.slope, flat_naive, absorbed)
    assert "0.62 of the naive one" in not_seen_note(capsys)
    # sweeps passed the wrong way round: graded on the arithmetic, and read as not showing the effect
    checks.check_absorbed_share(naive.fit.slope / absorbed.fit.slope, absorbed, naive)
    assert "40.00 of the naive one" in not_seen_note(capsys)
    # the second playtest: an absorbed line that fell with the context read as readable
    falling = fake_sweep(-0.5, 640.0, intercept_ms=20.0)
    checks.check_absorbed_share(falling.fit.slope / naive.fit.slope, naive, falling)
    assert "fell as the context grew" in not_seen_note(capsys)


# -- exercises 7 and 8 -----------------------------------------------------------------------------------------------
def test_absorbed_intensity_slips_are_named():
    def per_head_flops(cfg, size):
        m = cfg.mla
        return (
            2
            * cfg.n_heads
            * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
            / ((m.kv_lora_rank + m.qk_rope_head_dim) * size)
        )

    assert_fails(checks.check_absorbed_intensity, per_head_flops, match="attends in the latent|works in the latent")

    def no_rope(cfg, size):
        m = cfg.mla
        return 2 * cfg.n_heads * 2 * m.kv_lora_rank / ((m.kv_lora_rank + m.qk_rope_head_dim) * size)

    assert_fails(checks.check_absorbed_intensity, no_rope, match="RoPE part of the scores")


def test_absorbed_step_slips_are_named():
    def naive(cfg, context, batch):
        f = roofline.mla_attention_flops(cfg, context)
        flops = batch * (2 * roofline.active_params(cfg) + cfg.n_layers * (f.expand + f.attend_expanded))
        return flops, absorbed_step(cfg, context, batch)[1]

    assert_fails(checks.check_absorbed_step, naive, match="naive path")

    def weights_per_sequence(cfg, context, batch):
        flops, _ = absorbed_step(cfg, context, batch)
        return flops, batch * roofline.weight_bytes_read(cfg) + roofline.kv_bytes_per_step(cfg, context, batch)

    assert_fails(checks.check_absorbed_step, weights_per_sequence, match="a batch shares them")

    def batch_experts(cfg, context, batch):
        flops, n_bytes = absorbed_step(cfg, context, batch)
        extra = 2 * batch * (roofline.active_params(cfg, batch) - roofline.active_params(cfg))
        return flops + extra, n_bytes

    assert_fails(checks.check_absorbed_step, batch_experts, match="its own experts")
    assert_fails(checks.check_absorbed_step, lambda cfg, c, b: 7, match="a pair")


def test_mla_checks_refuse_a_config_without_mla():
    with pytest.raises(ValueError, match="MLA configs only"):
        checks.check_absorbed_intensity(absorbed_intensity, cases=[(get_model("cpu-tiny"), 4)])


def test_course_mla_shape_is_runnable_and_four_times_smaller():
    cfg = lesson06._course_mla(get_model("cpu-tiny"))
    assert cfg.mla == MLAConfig(kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64)
    assert cfg.runnable
    latent, mha = mla_kv_bytes(cfg, 4)
    assert mha == 4 * latent
