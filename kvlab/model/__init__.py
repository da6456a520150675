"""The decoder: a Llama-style model (``Decoder``: GQA/MQA/MHA or MLA attention, RoPE, SwiGLU, optional sliding-window
layers and weight precisions), its layers, sampling, the byte-level tokenizer with the passkey task's tokens, the
shipped checkpoints (``load_pretrained``) and Hugging Face conversion."""

from kvlab._lazy import lazy_exports

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "ASK": "kvlab.model.tokenizer",
    "Decoder": "kvlab.model.decoder",
    "EOT": "kvlab.model.tokenizer",
    "EOT_TEXT": "kvlab.model.tokenizer",
    "HELDOUT_FILE": "kvlab.model.pretrained",
    "N_PASSKEYS": "kvlab.model.tokenizer",
    "PASSKEY_BASE": "kvlab.model.tokenizer",
    "SamplingParams": "kvlab.model.sampling",
    "TokenLogprobs": "kvlab.model.sampling",
    "VOCAB_SIZE": "kvlab.model.tokenizer",
    "WEIGHT_DTYPES": "kvlab.model.weights",
    "WeightFormat": "kvlab.model.weights",
    "bos_token": "kvlab.model.pretrained",
    "choose": "kvlab.model.sampling",
    "decode": "kvlab.model.tokenizer",
    "encode": "kvlab.model.tokenizer",
    "from_hf": "kvlab.model.hf",
    "heldout_tokens": "kvlab.model.pretrained",
    "int8_step_weight_bytes": "kvlab.model.weights",
    "is_passkey": "kvlab.model.tokenizer",
    "list_pretrained": "kvlab.model.pretrained",
    "load_pretrained": "kvlab.model.pretrained",
    "native_half": "kvlab.model.weights",
    "passkey": "kvlab.model.tokenizer",
    "projection_shapes": "kvlab.model.weights",
    "set_absorb": "kvlab.model.decoder",
    "to_hf": "kvlab.model.hf",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
