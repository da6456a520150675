"""The engine's runner: it executes a scheduler's ``StepPlan`` on the model and a ``PagedKVCache``, and samples.

The cache replays the plan's pool operations in order (admissions with their token ids, frees, each call's stores),
so its block tables are the scheduler's (``execute`` checks the free counts agree before it returns). Each call
builds its token tensor (``[B]`` for a decode over a ragged batch, ``[1, T]`` for a prefill chunk), runs the model,
and samples each sampling row's next token (``kvlab.model.sampling.choose``) from its own generator.
"""

from __future__ import annotations

import torch

from kvlab.cache.storage.block_pool import BlockPool
from kvlab.cache.storage.paged import PagedKVCache
from kvlab.engine.request import Request, RequestHandle
from kvlab.engine.scheduler import Admit, Free, ScheduledCall, StepPlan
from kvlab.model.decoder import Decoder
from kvlab.model.sampling import TokenLogprobs, choose

Sampled = tuple[RequestHandle, int, TokenLogprobs | None]  # a request, its new token, and its logprobs if asked


class Runner:
    """``model`` over a ``PagedKVCache`` of ``n_blocks`` x ``block_size`` that mirrors ``pool`` (the scheduler's),
    storing ``kv_dtype`` with ``window`` + ``sinks`` as ``Engine`` takes them."""

    def __init__(
        self,
        model: Decoder,
        pool: BlockPool,
        *,
        kv_dtype: str | None = None,
        window: int | None = None,
        sinks: int = 0,
        prefix_caching: bool = True,
    ) -> None:
        self.model, self.pool, self.prefix_caching = model, pool, prefix_caching
        self.cache = PagedKVCache.for_model(
            model,
            0,  # no sequence yet: the plan's admissions add them
            n_blocks=pool.n_blocks,
            block_size=pool.block_size,
            codec=kv_dtype,
            window=window,
            sinks=sinks,
        )
        self._seq_ids: dict[int, int] = {}  # the scheduler's pool sequence -> the cache's

    def reject(self, request: Request) -> str | None:
        """Why the model cannot take ``request`` (None if it can)."""
        ids, vocab = request.prompt_ids, self.model.cfg.vocab_size
        if max(ids) >= vocab:
            return f"prompt_ids: ids up to {max(ids)}; allowed: 0 <= id < vocab_size={vocab}"
        return None

    def generator(self, request: Request) -> torch.Generator | None:
        """``request``'s own random stream on the model's device (None when it is greedy)."""
        return None if request.sampling is None else request.sampling.generator(self.model.device)

    def execute(self, plan: StepPlan) -> list[Sampled]:
        """Run ``plan``'s ops in order; return each sampled token, in the plan's sampling order."""
        sampled: list[Sampled] = []
        for op in plan.ops:
            if isinstance(op, Admit):
                self._seq_ids[op.seq_id], n_cached = self.cache.new_sequence(op.token_ids)
                if n_cached != op.n_cached:
                    raise RuntimeError(f"cache: {n_cached} prefix-hit tokens; the scheduler's pool has {op.n_cached}")
            elif isinstance(op, Free):
                self.cache.free(self._seq_ids.pop(op.seq_id))
            else:
                sampled += self._call(op)
        self._check_tables()
        return sampled

    def _call(self, call: ScheduledCall) -> list[Sampled]:
        device = self.model.device
        self.cache.use([self._seq_ids[s] for s in call.seq_ids])
        if call.decode:
            if self.prefix_caching:  # so the generated tokens' blocks are cached too (a preempted request reuses them)
                self.cache.feed_tokens(call.tokens)
            logits = self.model.decode_step(torch.tensor([t for (t,) in call.tokens], device=device), self.cache)
        else:
            logits = self.model.prefill(torch.tensor(call.tokens, device=device), self.cache)[:, -1]  # [1, V]
        if not call.samples:  # a chunk that leaves some of its prompt for the next step
            return []
        argmax = logits.argmax(-1).tolist()
        return [self._sample(x, row, token) for x, row, token in zip(call.samples, logits, argmax, strict=True)]

    def _sample(self, x: RequestHandle, logits: torch.Tensor, argmax: int) -> Sampled:
        """``x``'s next token from its ``logits`` ``[V]``: ``argmax`` (greedy), or as its sampling says."""
        if x.request.sampling is None:
            return x, argmax, None
        return (x, *choose(logits, x.request.sampling, x.generator, argmax))

    def _check_tables(self) -> None:
        """The cache holds what the scheduler planned. Equal free counts after every step catch a missed or extra
        operation (a window's release included) at the cost of two reads; comparing every table would cost a copy
        of each per step."""
        if self.cache.pool.n_free != self.pool.n_free:
            raise RuntimeError(
                f"cache: {self.cache.pool.n_free} free blocks where the scheduler's pool has {self.pool.n_free} (a "
                "pool operation of the plan was missed)"
            )
