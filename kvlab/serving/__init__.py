"""HTTP in and out: ``kvlab serve`` (an OpenAI-compatible server over the engine, ``kvlab.serving.server``) and
``kvlab bench --endpoint`` (a torch-free benchmark client for any OpenAI-compatible server,
``kvlab.serving.client``)."""

from kvlab._lazy import lazy_exports

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "BACKENDS": "kvlab.serving.client",
    "ENDPOINT_TYPES": "kvlab.serving.client",
    "EndpointError": "kvlab.serving.client",
    "RequestOptions": "kvlab.serving.client",
    "Server": "kvlab.serving.server",
    "base_url": "kvlab.serving.client",
    "load_model": "kvlab.serving.server",
    "load_tokenizer": "kvlab.serving.client",
    "measure_prompt_tokens": "kvlab.serving.client",
    "random_prompts": "kvlab.serving.client",
    "read_trace": "kvlab.serving.client",
    "run_benchmark": "kvlab.serving.client",
    "run_server": "kvlab.serving.server",
    "sweep_contexts": "kvlab.serving.client",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
