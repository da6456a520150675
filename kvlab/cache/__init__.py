"""KV cache layouts and policies; each reports the bytes it stores, reads and writes per step."""

from kvlab.cache.base import CacheCapacityError, KVCache
from kvlab.cache.block_pool import BlockPool, PoolExhaustedError
from kvlab.cache.cascade import cascade_decode_attention
from kvlab.cache.contiguous import ContiguousKVCache
from kvlab.cache.heavy_hitters import HeavyHitterKVCache
from kvlab.cache.paged import PagedKVCache
from kvlab.cache.quantized import QuantizedKVCache
from kvlab.cache.shared_prefix import SharedPrefixKVCache
from kvlab.cache.window import WindowKVCache

__all__ = [
    "BlockPool",
    "CacheCapacityError",
    "ContiguousKVCache",
    "HeavyHitterKVCache",
    "KVCache",
    "PagedKVCache",
    "PoolExhaustedError",
    "QuantizedKVCache",
    "SharedPrefixKVCache",
    "WindowKVCache",
    "cascade_decode_attention",
]
