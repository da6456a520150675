"""Small shared builders for the tests: tiny model shapes that run in milliseconds."""

from kvlab import ModelConfig


def tiny_config(**overrides) -> ModelConfig:
    base = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96, vocab_size=101, max_seq_len=128)
    return ModelConfig(**(base | overrides))
