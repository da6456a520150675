"""Serving one model: a continuous-batching ``Engine`` over the paged cache (requests in, tokens and vLLM's latencies
out) as nano-vllm and vLLM v1 lay it out: a ``Scheduler`` that plans each step on the block pool with integers only,
a ``Runner`` that executes the plan on the model, and a clock, real or a ``SimulatedClock`` that charges each step
the byte model's time (the capstone replays at scale with no model at all); a decode step replayed as
a CUDA graph (``GraphedDecodeStep``); speculative decoding (draft model or prompt lookup, verify, rollback).

    from kvlab.engine import Engine, Request
    engine = Engine(model, n_blocks=256, block_size=16, max_batch=8)  # model: a kvlab.Decoder
    report = engine.run([Request(prompt_ids, 32), Request(other_ids, 16, arrival_s=0.5)])
    report.results[0].output_ids, report.results[0].ttft_ms, report.output_tokens_per_s

What a user builds: ``Engine``, ``Request`` (and ``SamplingParams`` from ``kvlab.model``), ``SimulatedClock``; what
comes back: ``RunReport``, ``RequestResult`` (``.error`` set for a request the engine refused), ``RequestHandle``
(from ``Engine.add``). The parts underneath: ``Scheduler`` -> ``StepPlan`` (``Admit``, ``Free``, ``ScheduledCall``)
-> ``Runner``.
"""

from kvlab._lazy import lazy_exports

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "Admit": "kvlab.engine.scheduler",
    "Clock": "kvlab.engine.clock",
    "Engine": "kvlab.engine.engine",
    "FollowUp": "kvlab.engine.engine",
    "Free": "kvlab.engine.scheduler",
    "GraphedDecodeStep": "kvlab.engine.cuda_graphs",
    "ModelCall": "kvlab.engine.scheduler",
    "OnToken": "kvlab.engine.request",
    "PLACEHOLDER_TOKEN": "kvlab.engine.engine",
    "PROMPT_LOOKUP": "kvlab.engine.speculative",
    "RealClock": "kvlab.engine.clock",
    "Request": "kvlab.engine.request",
    "RequestHandle": "kvlab.engine.request",
    "RequestResult": "kvlab.engine.request",
    "RunReport": "kvlab.engine.request",
    "Runner": "kvlab.engine.runner",
    "ScheduledCall": "kvlab.engine.scheduler",
    "Scheduler": "kvlab.engine.scheduler",
    "SimulatedClock": "kvlab.engine.clock",
    "SpeculativeResult": "kvlab.engine.speculative",
    "StepPlan": "kvlab.engine.scheduler",
    "accept_greedy": "kvlab.engine.speculative",
    "inflate_mlp": "kvlab.engine.speculative",
    "prompt_lookup": "kvlab.engine.speculative",
    "speculative_generate": "kvlab.engine.speculative",
    "time_verify_steps": "kvlab.engine.speculative",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
