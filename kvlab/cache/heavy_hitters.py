"""Heavy hitters (H2O, Zhang et al. 2023): keep the tokens that have drawn the most attention, plus the newest.

With ``heavy=H`` and ``recent=R``: the R most recent tokens (the newest included) always stay; of the others, the
H with the largest accumulated attention stay. A token's score is the sum of the attention probabilities it has
received since it was written: over steps, over the queries of a step, and over the G query heads that share its
KV head. Positions stay original (keys keep the RoPE angle they were written with).

Granularity: one score, and one eviction decision, per layer, per sequence and per KV head. A KV head's K/V row
is what eviction frees, and under GQA that row serves G query heads, so the decision cannot be finer than a KV
head; summing those G heads' attention keeps the row any of them relies on. Coarser (one decision for all heads)
would force heads that attend to different tokens to share a set. Each KV head thus keeps its own tokens; all
keep the same number, so the slab stays dense.

When: a decode step that finds the cache full evicts one token, the lowest-scoring one outside the R-1 newest,
writes its own token into that slot and attends over the H + R kept tokens. So a step reads H + R tokens, as
window + sinks reads S + W. This is H2O's algorithm with H heavy and R-1 recent slots (it attends over those plus
the new token), each eviction deferred to the start of the next step, where it compares the same scores. A
multi-token step (a prefill) needs its own attention to score its tokens, so it attends over the kept tokens and
all its new ones, then evicts down to H + R. Exact ties (equal sums of probabilities) are broken arbitrarily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvlab.cache.policies import PolicyKVCache, attention_with_probs, require_kv_heads
from kvlab.kernels import window_mask
from kvlab.validation import require_int

if TYPE_CHECKING:
    from kvlab.model import Decoder

# A step view: keys [B, Hkv, D, n], values [B, Hkv, n, D], positions and scores [B, Hkv, n].
_View = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class HeavyHitterKVCache(PolicyKVCache):
    """Keep the ``recent`` newest tokens and the ``heavy`` others with the most accumulated attention.

    ``capacity``: the most tokens a sequence may reach (``None``: unbounded). Besides K/V, each kept slot carries
    an fp32 score and an int64 position; the byte methods count them (``score_bytes_*``).
    """

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        head_dim: int,
        heavy: int,
        recent: int,
        capacity: int | None = None,
        dtype: str | torch.dtype = "fp32",
        device: str | torch.device = "cpu",
    ) -> None:
        require_int("n_layers", n_layers, 1)
        require_int("heavy", heavy, 0)
        require_int("recent", recent, 1)  # the newest token must stay: its own query attends to it
        self.heavy, self.recent = heavy, recent
        super().__init__(
            n_layers, batch_size, n_kv_heads, head_dim, [heavy + recent] * n_layers, capacity, dtype, device
        )
        shape = (batch_size, n_kv_heads, self._k_t[0].shape[-1])
        self._scores = [torch.zeros(shape, dtype=torch.float32, device=device) for _ in range(n_layers)]
        self._positions = [torch.zeros(shape, dtype=torch.int64, device=device) for _ in range(n_layers)]
        # Multi-token steps whose eviction waits for their attention (or for the next step, if none comes).
        self._pending: dict[int, _View] = {}

    @classmethod
    def for_model(
        cls,
        model: Decoder,
        batch_size: int = 1,
        capacity: int | None = None,
        *,
        heavy: int,
        recent: int,
        kv_dtype: str | None = None,
    ) -> HeavyHitterKVCache:
        """A cache shaped for ``model``; ``functools.partial(..., heavy=.., recent=..)`` is a cache factory."""
        require_kv_heads(model)
        cfg = model.cfg
        return cls(
            cfg.n_layers,
            batch_size,
            cfg.n_kv_heads,
            cfg.head_dim,
            heavy,
            recent,
            capacity=capacity,
            dtype=kv_dtype or model.dtype,
            device=model.device,
        )

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
        start, end, t = self._start, self._seen, k.shape[1]
        n_old = self.held(layer, start)
        positions, scores = self._positions[layer], self._scores[layer]
        if t > 1:
            view_k_t, view_v = self._step_view(layer, torch.arange(n_old, device=self.device), k, v)
            new_positions = torch.arange(start, end, device=self.device).expand(self.batch_size, self.n_kv_heads, t)
            self._pending[layer] = (
                view_k_t,
                view_v,
                torch.cat((positions[..., :n_old], new_positions), dim=-1),
                torch.cat((scores[..., :n_old], scores.new_zeros(self.batch_size, self.n_kv_heads, t)), dim=-1),
            )
            return
        if n_old < positions.shape[-1]:
            slot = positions.new_full((self.batch_size, self.n_kv_heads, 1), n_old)
        else:
            slot = self._priority(positions, scores, newest=start).argmin(dim=-1, keepdim=True)  # [B, Hkv, 1]
        d = self.head_dim
        self._k_t[layer].scatter_(-1, slot[:, :, None, :].expand(-1, -1, d, -1), k[:, 0, :, :, None])
        self._v[layer].scatter_(-2, slot[..., None].expand(-1, -1, -1, d), v[:, 0, :, None, :])
        scores.scatter_(-1, slot, 0.0)
        positions.scatter_(-1, slot, start)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        view = self._pending.pop(layer, None)
        if view is None:
            n = self.held(layer)
            out, probs = attention_with_probs(self._grouped(q), self._k_t[layer][..., :n], self._v[layer][:, :, :n])
            self._scores[layer][..., :n] += probs.sum(dim=(2, 3)).float()
            return self._ungrouped(out)
        k_t, v, positions, scores = view
        n_all, t = positions.shape[-1], q.shape[1]
        columns = torch.arange(n_all, device=self.device)
        mask = window_mask(columns[n_all - t :], columns)  # the kept tokens precede the new ones: causal by column
        out, probs = attention_with_probs(self._grouped(q), k_t, v, mask)
        scores += probs.sum(dim=(2, 3)).float()
        self._commit(layer, view)
        return self._ungrouped(out)

    def _commit(self, layer: int, view: _View) -> None:
        """Keep the best ``budget`` tokens of a multi-token step's view, in slots ``0 .. n-1``."""
        k_t, v, positions, scores = view
        n = min(positions.shape[-1], self._k_t[layer].shape[-1])
        keep = self._priority(positions, scores, newest=self._seen - 1).topk(n, dim=-1).indices  # [B, Hkv, n]
        d = self.head_dim
        self._k_t[layer][..., :n] = k_t.gather(-1, keep[:, :, None, :].expand(-1, -1, d, -1))
        self._v[layer][:, :, :n] = v.gather(-2, keep[..., None].expand(-1, -1, -1, d))
        self._positions[layer][..., :n] = positions.gather(-1, keep)
        self._scores[layer][..., :n] = scores.gather(-1, keep)

    def _flush(self) -> None:
        """Commit multi-token steps that no attention followed (``fast_fill``): their new tokens score zero."""
        for layer in list(self._pending):
            self._commit(layer, self._pending.pop(layer))

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
        slots = sum(k_t.shape[-1] for k_t in self._k_t)
        return super().bytes_allocated() + self.batch_size * self.n_kv_heads * slots * self._bookkeeping_bytes

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
