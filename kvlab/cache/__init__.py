"""KV caches on three independent axes, each reporting the bytes it stores, reads and writes per step.

- storage (``storage/``), where a token's K/V sit: ``ContiguousKVCache`` and ``StaticKVCache`` (one slab),
  ``PagedKVCache`` (blocks of a ``BlockPool``), ``LatentKVCache`` (MLA's latent, stored once), ``SharedPrefixKVCache``
  (a prefix slab shared by the batch);
- policy (``policy/``), which tokens stay: everything, ``WindowKVCache`` (sinks + a window, or a model's local
  layers), ``HeavyHitterKVCache`` (H2O);
- codec (``codec/``), how their bytes are encoded: any of ``kvlab.spec.KV_DTYPES``, through ``get_codec`` and the
  stores (``QuantizedKVCache`` is KIVI's own layout: keys grouped along tokens, which only an append-only slab
  allows)."""

from kvlab._lazy import lazy_exports

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "ATTENTION_PATHS": "kvlab.cache.codec.kivi",
    "BlockPool": "kvlab.cache.storage.block_pool",
    "CacheCapacityError": "kvlab.cache.base",
    "CacheFactory": "kvlab.cache.base",
    "CacheRollbackError": "kvlab.cache.base",
    "CacheShape": "kvlab.cache.base",
    "ContiguousKVCache": "kvlab.cache.storage.slab",
    "FLOAT_DTYPES": "kvlab.cache.base",
    "HOLE": "kvlab.cache.storage.block_pool",
    "HeavyHitterKVCache": "kvlab.cache.policy.heavy_hitters",
    "IntCodec": "kvlab.cache.codec.codecs",
    "KEY_QUANT": "kvlab.cache.codec.kivi",
    "KVCache": "kvlab.cache.base",
    "KeepPolicy": "kvlab.cache.policy.keep",
    "LatentKVCache": "kvlab.cache.storage.latent",
    "POSITIONS": "kvlab.cache.policy.window",
    "PagedKVCache": "kvlab.cache.storage.paged",
    "PoolExhaustedError": "kvlab.cache.storage.block_pool",
    "QuantizedKVCache": "kvlab.cache.codec.kivi",
    "ROLLBACK_CACHES": "kvlab.cache.base",
    "SharedPrefixKVCache": "kvlab.cache.storage.shared_prefix",
    "StaticKVCache": "kvlab.cache.storage.slab",
    "WindowKVCache": "kvlab.cache.policy.window",
    "chain_hash": "kvlab.cache.storage.block_pool",
    "codec_error": "kvlab.cache.codec.kivi",
    "default_cache": "kvlab.cache.base",
    "get_codec": "kvlab.cache.codec.codecs",
    "int_tuple": "kvlab.cache.storage.block_pool",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
