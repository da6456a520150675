"""The engine's scheduler alone: plans made against a BlockPool, with no model and no tensors."""

from __future__ import annotations

import json
import subprocess
import sys

from kvlab.cache.storage.block_pool import HOLE, BlockPool
from kvlab.engine.request import Request, RequestHandle
from kvlab.engine.scheduler import Admit, Free, ScheduledCall, Scheduler, StepPlan

TOKEN = 7  # what every planned sample "returns": the scheduler never looks at a token's value but for stop ids


def handle(prompt: list[int], max_new: int) -> RequestHandle:
    return RequestHandle(-1, Request(prompt, max_new), 0.0)


def step(s: Scheduler) -> StepPlan:
    """One planned step, each of its samples recorded as TOKEN (as the engine does after a runner ran it)."""
    plan = s.schedule()
    for x in plan.samples:
        s.record(x, TOKEN)
    return plan


def test_importing_the_scheduler_and_the_clocks_loads_no_torch() -> None:
    probe = (
        "import json, sys\nimport kvlab.engine.scheduler, kvlab.engine.clock\nprint(json.dumps('torch' in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) is False


def test_admission_stops_when_the_pool_cannot_hold_another_prompt_and_decode() -> None:
    # Blocks of 4: a 7-token prompt and its first decode (8 tokens) take 2 blocks; 7 blocks admit 3 (6 <= 7 < 8).
    s = Scheduler(BlockPool(7, 4), max_batch=8, token_budget=512)
    xs = [handle(list(range(10 * i, 10 * i + 7)), 2) for i in range(6)]
    s.waiting.extend(xs)
    plan = step(s)
    assert [op.seq_id for op in plan.ops if isinstance(op, Admit)] == [x.seq_id for x in xs[:3]]
    assert list(s.waiting) == xs[3:]
    # Each admitted prompt is one prefill call of its 7 tokens, which samples its first token.
    assert [c.rows for c in plan.calls] == [((7, 0),)] * 3
    assert [c.samples for c in plan.calls] == [(x,) for x in xs[:3]]
    assert s.max_running == 3 and s.pool.n_free == 7 - 3 * 2


def test_max_batch_caps_admission() -> None:
    s = Scheduler(BlockPool(64, 4), max_batch=2)
    s.waiting.extend(handle([1, 2, 3], 4) for _ in range(5))
    step(s)
    assert len(s.running) == 2 and len(s.waiting) == 3


def test_chunked_prefill_spends_the_token_budget_after_the_decodes() -> None:
    s = Scheduler(BlockPool(64, 4), token_budget=5)
    a = handle(list(range(12)), 4)
    s.waiting.append(a)
    # 12 prompt tokens under a budget of 5: chunks of 5, 5 and 2; only the last samples.
    plans = [step(s) for _ in range(3)]
    assert [c.rows for p in plans for c in p.calls] == [((5, 0),), ((5, 5),), ((2, 10),)]
    assert [c.samples for p in plans for c in p.calls] == [(), (), (a,)]
    # A second request now shares the step: a's decode takes 1 of the 5 tokens, b's chunk the other 4.
    b = handle(list(range(100, 112)), 4)
    s.waiting.append(b)
    plan = step(s)
    decode, chunk = plan.calls
    assert decode.decode and decode.rows == ((1, 12),) and decode.tokens == ((TOKEN,),)
    assert not chunk.decode and chunk.rows == ((4, 0),) and chunk.tokens == (tuple(range(100, 104)),)


def test_preemption_frees_the_newest_first_and_readmission_hits_its_cached_prompt() -> None:
    # 4 blocks of 4. a and b: 4-token prompts (one block each), 6 new tokens. Both are admitted (2 blocks each for
    # prompt + first decode). Decodes run them to 8 tokens each, 2 blocks each, the pool full; the next decode
    # starts a block per row, so b, the newest, is preempted and a decodes alone.
    s = Scheduler(BlockPool(4, 4))
    a, b = handle([1, 2, 3, 4], 6), handle([5, 6, 7, 8], 6)
    s.waiting.extend([a, b])
    plans = [step(s) for _ in range(6)]
    b_seq = plans[0].ops[1].seq_id
    assert all(not p.preempted for p in plans[:5])
    last = plans[5]
    assert last.preempted == [b] and b.preemptions == 1 and s.preemptions == 1 and list(s.waiting) == [b]
    free_b, call, free_a = last.ops
    assert free_b == Free(b_seq) and isinstance(call, ScheduledCall) and call.rows == ((1, 8),)
    # a sampled its 6th token in that call: its blocks went back right after it.
    assert isinstance(free_a, Free) and len(a.output) == 6 and a.done and not s.running
    # b comes back with prompt + its 5 tokens; its prompt block was freed last (tail blocks go first), so it hits.
    readmit = step(s)
    admit = readmit.ops[0]
    assert isinstance(admit, Admit) and admit.n_cached == 4 and s.prefix_hit_tokens == 4
    assert readmit.calls[0].rows == ((9 - 4, 4),) and len(b.output) == 6 and b.done


def test_prefix_hits_skip_the_cached_blocks_of_an_earlier_prompt() -> None:
    shared = list(range(8))  # two full blocks of 4
    for caching, expect in ((True, 8), (False, 0)):
        s = Scheduler(BlockPool(32, 4), prefix_caching=caching)
        s.waiting.append(handle([*shared, 40, 41], 3))
        step(s)
        s.waiting.append(handle([*shared, 50, 51], 3))
        plan = step(s)
        admit = next(op for op in plan.ops if isinstance(op, Admit))
        assert admit.n_cached == s.prefix_hit_tokens == expect
        assert plan.calls[-1].rows == ((10 - expect, expect),)


def test_a_window_gives_back_the_blocks_no_query_sees() -> None:
    # Blocks of 2, window 4, no sinks: a sequence holds at most ceil(4 / 2) + 1 = 3 blocks however long it grows.
    s = Scheduler(BlockPool(8, 2), window=4)
    x = handle([1, 2, 3], 20)
    s.waiting.append(x)
    for _ in range(15):
        step(s)
        table = s.pool.block_table(x.seq_id)
        assert sum(b != HOLE for b in table) <= 3
    assert HOLE in table and s.pool.length(x.seq_id) == 3 + 14


def test_a_stop_token_frees_the_request_after_the_step() -> None:
    from kvlab.model.sampling import SamplingParams

    s = Scheduler(BlockPool(8, 4))
    x = RequestHandle(-1, Request([1, 2, 3], 10, sampling=SamplingParams(stop_token_ids=frozenset({TOKEN}))), 0.0)
    s.waiting.append(x)
    plan = s.schedule()
    assert s.pool.n_free < 8  # the plan cannot know the token: x still holds its blocks
    assert s.record(x, TOKEN) and x.stopped and not s.running and s.pool.n_free == 8
    assert s.schedule().ops == [Free(plan.ops[0].seq_id)]  # the runner's cache hears of it with the next plan
