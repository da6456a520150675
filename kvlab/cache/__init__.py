"""KV caches on three independent axes, each reporting the bytes it stores, reads and writes per step.

- storage, where a token's K/V sit: ``ContiguousKVCache`` (one slab), ``PagedKVCache`` (blocks of a pool),
  ``LatentKVCache`` (MLA's latent, stored once), ``SharedPrefixKVCache`` (a prefix slab shared by the batch);
- policy, which tokens stay: everything, ``WindowKVCache`` (sinks + a window, or a model's local layers),
  ``HeavyHitterKVCache`` (H2O);
- codec, how their bytes are encoded: any of ``kvlab.spec.dtypes.KV_DTYPES``, through ``kvlab.cache.codec.stores``
  (``QuantizedKVCache`` is KIVI's own layout: keys grouped along tokens, which only an append-only slab allows).
"""

from kvlab.cache.base import CacheCapacityError, CacheFactory, CacheShape, KVCache
from kvlab.cache.codec.kivi import QuantizedKVCache
from kvlab.cache.policy.heavy_hitters import HeavyHitterKVCache
from kvlab.cache.policy.window import WindowKVCache
from kvlab.cache.storage.block_pool import BlockPool, PoolExhaustedError
from kvlab.cache.storage.latent import LatentKVCache
from kvlab.cache.storage.paged import PagedKVCache
from kvlab.cache.storage.shared_prefix import SharedPrefixKVCache
from kvlab.cache.storage.slab import ContiguousKVCache

__all__ = [
    "BlockPool",
    "CacheCapacityError",
    "CacheFactory",
    "CacheShape",
    "ContiguousKVCache",
    "HeavyHitterKVCache",
    "KVCache",
    "LatentKVCache",
    "PagedKVCache",
    "PoolExhaustedError",
    "QuantizedKVCache",
    "SharedPrefixKVCache",
    "WindowKVCache",
]
