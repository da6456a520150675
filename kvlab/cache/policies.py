"""What every retention policy shares: a cache that keeps only some of a sequence's tokens, in fixed slots.

A policy decides which tokens stay; this module holds the storage and the attention that do not depend on the
decision. Per layer there is one slab of a fixed number of slots, keys key-major ``[B, Hkv, D, slots]`` and values
``[B, Hkv, slots, D]`` as in the contiguous cache, so a decode step streams them the same way. A decode step writes
its token in place, into the slot of a token the policy has just dropped, and attends over the slots in use: it
reads what the policy keeps, never the history, and nothing is copied.

A multi-token step (a prefill) may need tokens that the step itself evicts: its first queries still see tokens
that its last ones no longer keep. Such a step attends over a *step view*, the kept tokens plus the new ones
gathered into one transient tensor, and only then is the slab brought to what the policy keeps.

The policies: ``WindowKVCache`` (window + sinks, per-layer windows; ``kvlab.cache.window``) and
``HeavyHitterKVCache`` (H2O; ``kvlab.cache.heavy_hitters``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvlab.cache.base import CacheCapacityError, KVCache
from kvlab.dtypes import canonical_dtype, torch_dtype
from kvlab.validation import require_int

if TYPE_CHECKING:
    from kvlab.model import Decoder


def attention_with_probs(
    q: torch.Tensor,
    k_t: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    sink_q: torch.Tensor | None = None,
    n_sinks: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped attention that also returns its probabilities (what H2O accumulates).

    ``q``: ``[B, Hkv, G, T, D]``, already scaled by ``1/sqrt(D)``. ``k_t``: ``[B, Hkv, D, n]`` (key-major).
    ``v``: ``[B, Hkv, n, D]``. ``mask``: bool ``[T, n]``, True where visible. ``sink_q``, shaped like ``q``,
    replaces ``q`` for the first ``n_sinks`` keys (the re-assigned-positions window scores sinks with a rotated
    query). Returns ``out``: ``[B, Hkv, G, T, D]`` and ``probs``: ``[B, Hkv, G, T, n]``.
    """
    b, hkv, g, t, d = q.shape
    scores = torch.matmul(q.reshape(b, hkv, g * t, d), k_t)
    if sink_q is not None:
        scores[..., :n_sinks] = torch.matmul(sink_q.reshape(b, hkv, g * t, d), k_t[..., :n_sinks])
    scores = scores.view(b, hkv, g, t, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.view(b, hkv, g * t, -1), v).view(b, hkv, g, t, d)
    return out, probs


def require_kv_heads(model: Decoder) -> None:
    """Refuse a model whose cache is not per-head K/V (MLA caches one latent per token)."""
    if model.cfg.mla is not None:
        raise ValueError(
            f"model: {model.cfg.name} uses MLA, whose latent cache these policies do not manage; "
            "allowed: an MHA, GQA or MQA model"
        )


class PolicyKVCache(KVCache):
    """Slabs of fixed slots per layer, for a policy that keeps at most ``keep[layer]`` tokens of each sequence.

    ``keep[layer]`` is ``None`` where a layer keeps everything (it then needs ``capacity`` slots). ``capacity`` is
    the most tokens a sequence may reach (``None``: unbounded, when every layer keeps a bounded number); no slab is
    larger than ``capacity``. A subclass decides which slot each token goes to and which tokens a step sees.
    """

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        head_dim: int,
        keep: Sequence[int | None],
        capacity: int | None,
        dtype: str | torch.dtype,
        device: str | torch.device,
    ) -> None:
        for name, value in (
            ("n_layers", n_layers),
            ("batch_size", batch_size),
            ("n_kv_heads", n_kv_heads),
            ("head_dim", head_dim),
        ):
            require_int(name, value, 1)
        if capacity is not None:
            require_int("capacity", capacity, 1)
        elif None in keep:
            raise ValueError("capacity: None is not allowed when a layer keeps every token; allowed: an integer >= 1")
        self.n_layers, self.batch_size, self.capacity = n_layers, batch_size, capacity
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self._keep = list(keep)
        self.dtype_name = canonical_dtype(dtype, "kv dtype", allowed=("fp32", "fp16", "bf16"))
        tdtype = torch_dtype(self.dtype_name)
        slots = [min(bound for bound in (n, capacity) if bound is not None) for n in keep]
        shape = (batch_size, n_kv_heads)
        self._k_t = [torch.zeros(*shape, head_dim, s, dtype=tdtype, device=device) for s in slots]
        self._v = [torch.zeros(*shape, s, head_dim, dtype=tdtype, device=device) for s in slots]
        self._scale = 1.0 / math.sqrt(head_dim)
        self._seen = 0
        self._start = 0

    # -- shape ---------------------------------------------------------------------------------------------------
    @property
    def n_seen(self) -> int:
        """Tokens each sequence has had, kept or evicted (including the step in progress): the next position."""
        return self._seen

    @property
    def length(self) -> int:
        """Tokens stored per sequence in the layer that keeps the most."""
        return max(self.held(layer) for layer in range(self.n_layers))

    def held(self, layer: int, n_seen: int | None = None) -> int:
        """Tokens ``layer`` holds per sequence once ``n_seen`` tokens (default: so far) have gone through it."""
        n_seen = self._seen if n_seen is None else n_seen
        keep = self._keep[layer]
        return n_seen if keep is None else min(n_seen, keep)

    @property
    def element_bytes(self) -> float:
        return self._k_t[0].element_size()

    @property
    def device(self) -> torch.device:
        return self._k_t[0].device

    @property
    def torch_dtype(self) -> torch.dtype:
        return self._k_t[0].dtype

    # -- a step --------------------------------------------------------------------------------------------------
    def reserve(self, n_new: int) -> int:
        require_int("n_new", n_new, 1)
        if self.capacity is not None and self._seen + n_new > self.capacity:
            raise CacheCapacityError(
                f"KV cache full: {self._seen} tokens seen, {n_new} more requested, capacity {self.capacity}. "
                "Create the cache with a larger capacity."
            )
        self._start = self._seen
        self._seen += n_new
        return self._start

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the kept keys and values, ``[B, Hkv, n, D]`` each, in slot order (see ``kept_positions``)."""
        n = self.held(layer)
        return self._k_t[layer][..., :n].transpose(-1, -2), self._v[layer][:, :, :n]

    def reset(self) -> None:
        self._seen = 0
        self._start = 0

    def _grouped(self, q: torch.Tensor) -> torch.Tensor:
        """``[B, T, H, D]`` -> ``[B, Hkv, G, T, D]``, scaled by ``1/sqrt(D)``: the G query heads of each KV head."""
        b, t, h, d = q.shape
        return (q * self._scale).transpose(1, 2).reshape(b, self.n_kv_heads, h // self.n_kv_heads, t, d)

    @staticmethod
    def _ungrouped(out: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, G, T, D]`` -> ``[B, T, H, D]``."""
        b, hkv, g, t, d = out.shape
        return out.reshape(b, hkv * g, t, d).transpose(1, 2)

    def _step_view(
        self, layer: int, old_slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept tokens at ``old_slots`` followed by this step's, copied: ``[B, Hkv, D, n]``, ``[B, Hkv, n, D]``.

        ``k``, ``v``: ``[B, T, Hkv, D]`` as ``append`` takes them.
        """
        k_t = torch.cat((self._k_t[layer].index_select(-1, old_slots), k.permute(0, 2, 3, 1)), dim=-1)
        v = torch.cat((self._v[layer].index_select(-2, old_slots), v.transpose(1, 2)), dim=-2)
        return k_t, v

    # -- bytes ---------------------------------------------------------------------------------------------------
    @property
    def _token_layer_bytes(self) -> float:
        """K and V bytes of one token of one sequence in one layer."""
        return 2 * self.n_kv_heads * self.head_dim * self.element_bytes

    def bytes_stored(self) -> int:
        """K/V bytes of the tokens kept now, summed over layers (a local layer holds at most its window)."""
        tokens = sum(self.held(layer) for layer in range(self.n_layers))
        return round(self.batch_size * tokens * self._token_layer_bytes)

    def bytes_allocated(self) -> int:
        """The slabs, allocated up front: at most what the policy keeps per layer, never more than ``capacity``."""
        slots = sum(k_t.shape[-1] for k_t in self._k_t)
        return round(self.batch_size * slots * self._token_layer_bytes)

    def bytes_read_per_step(self, context: int | None = None) -> int:
        """K/V bytes a decode step reads when its sequences have ``context`` tokens (default: ``n_seen``).

        Each layer reads only what it keeps: ``min(context, keep)`` tokens, not the history.
        """
        context = self._seen if context is None else context
        require_int("context", context, 0)
        tokens = sum(self.held(layer, context) for layer in range(self.n_layers))
        return round(self.batch_size * tokens * self._token_layer_bytes)
