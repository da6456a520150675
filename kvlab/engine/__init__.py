"""Serving one model: a continuous-batching ``Engine`` over the paged cache (requests in, tokens and vLLM's latencies
out), on a real clock or a ``SimulatedClock`` that charges each step the byte model's time; a decode step replayed as
a CUDA graph (``GraphedDecodeStep``); speculative decoding (draft model or prompt lookup, verify, rollback)."""

from kvlab._lazy import lazy_exports

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "Clock": "kvlab.engine.engine",
    "Engine": "kvlab.engine.engine",
    "GraphedDecodeStep": "kvlab.engine.cuda_graphs",
    "ModelCall": "kvlab.engine.engine",
    "OnToken": "kvlab.engine.engine",
    "PROMPT_LOOKUP": "kvlab.engine.speculative",
    "Request": "kvlab.engine.engine",
    "RequestResult": "kvlab.engine.engine",
    "RunReport": "kvlab.engine.engine",
    "SimulatedClock": "kvlab.engine.engine",
    "SpeculativeResult": "kvlab.engine.speculative",
    "accept_greedy": "kvlab.engine.speculative",
    "inflate_mlp": "kvlab.engine.speculative",
    "prompt_lookup": "kvlab.engine.speculative",
    "speculative_generate": "kvlab.engine.speculative",
    "time_verify_steps": "kvlab.engine.speculative",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
