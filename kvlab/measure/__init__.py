"""What the lessons time and score on this machine: context sweeps of TPOT against the byte model (``Sweep``,
``interleaved_sweeps``), a decode step's time by part (``breakdown``), quality (perplexity, passkey recall, attention
sinks), chat sessions under a context cap, and the training script of the shipped checkpoints."""

from kvlab._lazy import lazy_exports

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "Arm": "kvlab.measure.sweep",
    "CHANCE": "kvlab.measure.quality",
    "ChatSession": "kvlab.measure.session",
    "NeedleResult": "kvlab.measure.quality",
    "PerplexityResult": "kvlab.measure.quality",
    "Rebuild": "kvlab.measure.session",
    "Sweep": "kvlab.measure.sweep",
    "SweepPoint": "kvlab.measure.sweep",
    "attention_sink_share": "kvlab.measure.quality",
    "breakdown": "kvlab.measure.step_time",
    "breakdown_table": "kvlab.measure.step_time",
    "interleaved_sweeps": "kvlab.measure.sweep",
    "layer_weights": "kvlab.measure.step_time",
    "needle_prompts": "kvlab.measure.quality",
    "needle_recall": "kvlab.measure.quality",
    "perplexity": "kvlab.measure.quality",
    "sweep_context": "kvlab.measure.sweep",
    "time_request": "kvlab.measure.sweep",
    "turns_to_drop": "kvlab.measure.session",
    "uniform_first_token_share": "kvlab.measure.quality",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
