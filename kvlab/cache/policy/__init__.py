"""Which tokens stay: a fixed set of slots (``FixedSlotsKVCache``), sinks + a sliding window, and heavy hitters
(H2O)."""
