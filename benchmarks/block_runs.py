"""How often a decode step can read its sequence's blocks in place: lesson 05's multi-turn chat, replayed on the
block pool alone.

    python benchmarks/block_runs.py               # lesson 05's full-size chat: 2 sessions of 6 turns
    python benchmarks/block_runs.py --sessions 4 --turns 10

The paged cache reads a one-sequence step in place when the sequence's blocks are consecutive ids
(``PagedKVCache._run_start``), and gathers them into a copy otherwise. This replays the chat's allocations as
``kvlab.engine.engine.Engine`` makes them with prefix caching on (one request at a time: the prompt's cached blocks
shared, the rest of the prompt appended, then one token per decode step), with random token ids, and counts the
decode steps whose table is one run. No model runs: the share is a property of the allocator.
``--room`` sizes the pool as a multiple of lesson 05's, which fits the chat exactly.
"""

from __future__ import annotations

import argparse
import math
import random

from kvlab.cache.storage.block_pool import BlockPool


def consecutive(table: list[int]) -> bool:
    return all(b - a == 1 for a, b in zip(table, table[1:], strict=False))


def replay(
    sessions: int, turns: int, first: int, message: int, answer: int, block: int, seed: int, room: float = 1.0
) -> tuple[int, int]:
    """(decode steps read in place, decode steps) over the chat."""
    rng = random.Random(seed)
    final = first + (turns - 1) * (answer + message)
    pool = BlockPool(round(room * (sessions * math.ceil((final + answer) / block) + 4)), block)  # room 1: lesson 05's
    prompts: list[list[int]] = [[] for _ in range(sessions)]
    in_place = steps = 0

    def serve(prompt: list[int], n_new: int) -> list[int]:
        nonlocal in_place, steps
        # As PagedKVCache.new_sequence: whole cached blocks, short of the last prompt token (its logits are needed)
        seq, cached = pool.add_sequence(prompt, (len(prompt) - 1) // block * block)
        pool.append([seq], len(prompt) - cached, [prompt[cached:]])
        out = []
        for _ in range(n_new):
            token = rng.randrange(256)
            pool.append([seq], 1, [[token]])
            steps += 1
            in_place += consecutive(pool.block_table(seq))
            out.append(token)
        pool.free(seq)
        return out

    serve([rng.randrange(256) for _ in range(first)], 4)  # the engine's warm-up request
    for turn in range(turns):
        for s in range(sessions):
            prompts[s] += [rng.randrange(256) for _ in range(first if turn == 0 else message)]
            prompts[s] += serve(prompts[s], answer)
    return in_place, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--first", type=int, default=512, help="the first message's tokens")
    parser.add_argument("--message", type=int, default=96, help="each later message's tokens")
    parser.add_argument("--answer", type=int, default=24, help="tokens generated per turn")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--room", type=float, default=1.0, help="pool size over lesson 05's (which fits the chat)")
    args = parser.parse_args()
    total_in, total = 0, 0
    for seed in range(args.seeds):
        a, n = replay(
            args.sessions, args.turns, args.first, args.message, args.answer, args.block_size, seed, args.room
        )
        total_in, total = total_in + a, total + n
    print(f"decode steps read in place: {total_in} of {total} ({total_in / total:.0%}), {args.seeds} seeds")


if __name__ == "__main__":
    main()
