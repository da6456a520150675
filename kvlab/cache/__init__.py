"""KV cache layouts and policies; each reports the bytes it stores, reads and writes per step."""

from kvlab.cache.base import CacheCapacityError, KVCache
from kvlab.cache.contiguous import ContiguousKVCache

__all__ = ["CacheCapacityError", "ContiguousKVCache", "KVCache"]
