"""Heavy hitters (H2O, Zhang et al. 2023): keep the tokens that have drawn the most attention, plus the newest.

With ``heavy=H`` and ``recent=R``: the R most recent tokens (the newest included) always stay; of the others, the
H with the largest accumulated attention stay. A token's score is the sum of the attention probabilities it has
received since it was written: over steps, over the queries of a step, and over the G query heads that share its
KV head. Positions stay original (keys keep the RoPE angle they were written with).

Granularity: one score, and one eviction decision, per layer, per sequence and per KV head. A KV head's K/V row
is what eviction frees, and under GQA that row serves G query heads, so the decision cannot be finer than a KV
head; summing those G heads' attention keeps the row any of them relies on. Coarser (one decision for all heads)
would force heads that attend to different tokens to share a set. Each KV head thus keeps its own tokens; all
keep the same number, so the store stays dense.

When: a decode step that finds the cache full evicts one token, the lowest-scoring one outside the R-1 newest,
writes its own token into that slot and attends over the H + R kept tokens. So a step reads H + R tokens, as
window + sinks reads S + W. This is H2O's algorithm with H heavy and R-1 recent slots (it attends over those plus
the new token), each eviction deferred to the start of the next step, where it compares the same scores. A
multi-token step (a prefill) needs its own attention to score its tokens, so it attends over the kept tokens and
all its new ones, then evicts down to H + R: the kept old tokens stay in their slots (as stored, never re-encoded)
and the new ones that stay fill the freed slots. Exact ties (equal sums of probabilities) are broken arbitrarily.

On a model with sliding-window layers a step masks the kept tokens past the layer's window (they draw no
attention, so no score) rather than read them.
"""

from __future__ import annotations

import torch

from kvlab.cache.base import CacheShape, Rotate, refuse_latent
from kvlab.cache.policy.slots import FixedSlotsKVCache
from kvlab.kernels.reference import attention_with_probs, window_mask
from kvlab.spec.validation import require_int


class HeavyHitterKVCache(FixedSlotsKVCache):
    """Keep the ``recent`` newest tokens and the ``heavy`` others with the most accumulated attention.

    ``capacity``: the most tokens a sequence may reach (``None``: unbounded). ``codec``, ``group_size``: how the
    kept K/V are stored (``FixedSlotsKVCache``). Besides K/V, each kept slot carries an fp32 score and an int64
    position per KV head; the byte methods count them (``score_bytes_*``).
    """

    def __init__(
        self,
        shape: CacheShape,
        batch_size: int = 1,
        capacity: int | None = None,
        *,
        heavy: int,
        recent: int,
        codec: str | None = None,
        group_size: int = 32,
    ) -> None:
        super().__init__(shape, batch_size, capacity, codec=codec, group_size=group_size)
        refuse_latent(shape, "HeavyHitterKVCache")  # H2O's per-head scores have no latent counterpart here
        require_int("heavy", heavy, 0)
        require_int("recent", recent, 1)  # the newest token must stay: its own query attends to it
        self.heavy, self.recent = heavy, recent
        self._allocate([heavy + recent] * self.n_layers)
        size = (batch_size, self.n_kv_heads, self._keys[0].slots)
        self._scores = [torch.zeros(size, dtype=torch.float32, device=self.device) for _ in range(self.n_layers)]
        self._positions = [torch.zeros(size, dtype=torch.int64, device=self.device) for _ in range(self.n_layers)]
        # Index of every (sequence, KV head) row, for a decode step's one slot per row: [B, 1, 1], [1, Hkv, 1].
        self._rows = (
            torch.arange(batch_size, device=self.device)[:, None, None],
            torch.arange(self.n_kv_heads, device=self.device)[None, :, None],
        )
        # Multi-token steps' K/V ([B, T, Hkv, D]), whose eviction waits for their attention (or the next step).
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def budget(self) -> int:
        """Tokens kept per layer, per sequence and per KV head: ``heavy + recent``."""
        return self.heavy + self.recent

    def kept_positions(self, layer: int) -> torch.Tensor:
        """The original position of the token in each used slot of ``layer``: ``[B, Hkv, n]`` (as ``read``)."""
        self._flush()
        return self._positions[layer][..., : self.held(layer)]

    def attention_scores(self, layer: int) -> torch.Tensor:
        """Accumulated attention of each kept token of ``layer``, ``[B, Hkv, n]``, in slot order."""
        self._flush()
        return self._scores[layer][..., : self.held(layer)]

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._flush()
        return super().read(layer)

    def _priority(self, positions: torch.Tensor, scores: torch.Tensor, newest: int) -> torch.Tensor:
        """Scores, with the ``recent`` positions up to ``newest`` (which always stay) raised to infinity."""
        return scores.masked_fill(positions > newest - self.recent, float("inf"))

    # -- a step --------------------------------------------------------------------------------------------------
    def reserve(self, n_new: int) -> int:
        self._flush()
        return super().reserve(n_new)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.shape[1] > 1:
            self._pending[layer] = (k, v)
            return
        start = self._start
        n_old = self.held(layer, start)
        positions, scores = self._positions[layer], self._scores[layer]
        if n_old < positions.shape[-1]:
            slot = positions.new_full((self.batch_size, self.n_kv_heads, 1), n_old)
        else:
            slot = self._priority(positions, scores, newest=start).argmin(dim=-1, keepdim=True)  # [B, Hkv, 1]
        index = (*self._rows, slot)
        self._write(layer, index, k.transpose(1, 2), v.transpose(1, 2))
        scores[index] = 0.0
        positions[index] = start

    def attend(
        self, layer: int, q: torch.Tensor, layer_window: int | None = None, rotate: Rotate | None = None
    ) -> torch.Tensor:
        pending = self._pending.pop(layer, None)
        q_positions = torch.arange(self._start, self._seen, device=self.device)
        if pending is None:
            n = self.held(layer)
            k, v = self._keys[layer].read(n), self._values[layer].read(n)
            positions, scores = self._positions[layer][..., :n], self._scores[layer][..., :n]  # views: += lands
            mask = None if layer_window is None else window_mask(q_positions, positions, layer_window)
        else:
            n_old = self.held(layer, self._start)
            k, v = self._step_view(layer, n_old, *pending)
            positions, scores = self._step_bookkeeping(layer, n_old)
            mask = window_mask(q_positions, positions, layer_window)  # [B, Hkv, T, n]: causal, by position
        out, probs = attention_with_probs(q, k.transpose(-1, -2), v, mask)
        scores += probs.sum(dim=(2, 3)).float()
        if pending is not None:
            self._commit(layer, *pending, positions, scores)
        return out

    def _step_bookkeeping(self, layer: int, n_old: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions and scores of a step view (the kept slots, then this step's tokens at score 0): ``[B, Hkv, n]``."""
        shape = (self.batch_size, self.n_kv_heads, self._seen - self._start)
        new = torch.arange(self._start, self._seen, device=self.device).expand(shape)
        return (
            torch.cat((self._positions[layer][..., :n_old], new), dim=-1),
            torch.cat((self._scores[layer][..., :n_old], self._scores[layer].new_zeros(shape)), dim=-1),
        )

    def _commit(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scores: torch.Tensor
    ) -> None:
        """Keep the best ``budget`` tokens of a multi-token step's view (``positions``, ``scores``: ``[B, Hkv, n]``,
        the kept slots then the step's ``k``, ``v``: ``[B, T, Hkv, D]``).

        A kept old token stays in its slot as stored; each new token that stays takes a slot freed by an evicted
        one (or an empty one), so only new tokens are encoded, once.
        """
        n_old = positions.shape[-1] - k.shape[1]
        n = min(positions.shape[-1], self._positions[layer].shape[-1])
        best = self._priority(positions, scores, newest=self._seen - 1).topk(n, dim=-1).indices  # [B, Hkv, n]
        kept = torch.zeros_like(positions, dtype=torch.bool).scatter_(-1, best, True)
        free = torch.ones(*positions.shape[:-1], n, dtype=torch.bool, device=self.device)
        free[..., :n_old] = ~kept[..., :n_old]
        # Every row has as many free slots as new tokens that stay (n in all), and nonzero lists both row by row,
        # so the j-th free slot and the j-th kept new token of a row pair up.
        slot = free.nonzero(as_tuple=True)
        b, h, i = kept[..., n_old:].nonzero(as_tuple=True)
        self._scores[layer][..., :n_old] = scores[..., :n_old]
        self._write(layer, slot, k[b, i, h], v[b, i, h])
        self._positions[layer][slot] = positions[b, h, n_old + i]
        self._scores[layer][slot] = scores[b, h, n_old + i]

    def _flush(self) -> None:
        """Commit multi-token steps that no attention followed (``fast_fill``): their new tokens score zero."""
        for layer in list(self._pending):
            k, v = self._pending.pop(layer)
            n_old = self.held(layer, self._start)
            self._commit(layer, k, v, *self._step_bookkeeping(layer, n_old))

    def reset(self) -> None:
        super().reset()
        self._pending.clear()

    # -- bytes ---------------------------------------------------------------------------------------------------
    @property
    def _bookkeeping_bytes(self) -> int:
        """Bytes of one slot's score plus its position, per KV head."""
        return self._scores[0].element_size() + self._positions[0].element_size()

    def bytes_stored(self) -> int:
        """K/V of the kept tokens plus their scores and positions."""
        tokens = sum(self.held(layer) for layer in range(self.n_layers))
        return super().bytes_stored() + self.batch_size * self.n_kv_heads * tokens * self._bookkeeping_bytes

    def bytes_allocated(self) -> int:
        bookkeeping = sum(s.numel() for s in self._scores) * self._bookkeeping_bytes
        return super().bytes_allocated() + bookkeeping

    def score_bytes_read_per_step(self, context: int | None = None) -> int:
        """Score bytes a decode step at ``context`` tokens reads, per KV head and layer: the n kept scores it
        adds to; and when the cache is full, every slot's score and position, to pick the token to evict."""
        context = self._seen if context is None else context
        require_int("context", context, 0)
        n, score = min(context, self.budget), self._scores[0].element_size()
        evict = self.budget * self._bookkeeping_bytes if context > self.budget else 0
        return self.batch_size * self.n_layers * self.n_kv_heads * (n * score + evict)

    def score_bytes_written_per_step(self, context: int | None = None) -> int:
        """Score bytes a decode step at ``context`` tokens writes, per KV head and layer: the new token's score
        and position, and the n kept scores it adds to."""
        context = self._seen if context is None else context
        require_int("context", context, 0)
        n, score = min(context, self.budget), self._scores[0].element_size()
        return self.batch_size * self.n_layers * self.n_kv_heads * (self._bookkeeping_bytes + n * score)

    def bytes_read_per_step(self, context: int | None = None) -> int:
        """K/V of the ``min(context, heavy + recent)`` kept tokens, plus the score bookkeeping."""
        return super().bytes_read_per_step(context) + self.score_bytes_read_per_step(context)

    def bytes_written_per_step(self, context: int | None = None) -> int:
        """One token's K/V per layer, plus the score bookkeeping."""
        return super().bytes_written_per_step() + self.score_bytes_written_per_step(context)
