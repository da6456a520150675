"""The runtimes a ``Decoder``'s decode step can run on, and what the compiled ones (``kvlab.model.onnx_step``,
``kvlab.model.numba_step``) share: which models they run, and a cheap check, at every step, that what they read of a
model's parameters is still what the model holds."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.modules import module as module_hooks

RUNTIMES: tuple[str, ...] = ("eager", "onnx", "onnx-packed", "numba")
ONNX_RUNTIMES: tuple[str, ...] = ("onnx", "onnx-packed")  # kvlab.model.onnx_step's


def model_problem(model: nn.Module) -> str | None:
    """Why a compiled step cannot run ``model``'s decode step on any cache, or None: they run dense fp32 MHA, GQA or
    MQA models on the CPU."""
    if model.cfg.mla is not None:
        return "an MLA model (its attention does not split at the cache); allowed: MHA, GQA or MQA"
    if model.weight_dtype != "fp32":
        return f"weight_dtype={model.weight_dtype!r}; allowed: 'fp32' (the compiled step reads the fp32 parameters)"
    if model.torch_dtype != torch.float32:
        return (
            f"a {model.torch_dtype} model; allowed: an fp32 model (a config with dtype='fp32', e.g. "
            "cfg.replace(dtype='fp32'), or kvlab.from_hf(path, dtype='fp32'))"
        )
    if model.device.type != "cpu":
        return f"a model on {model.device}; allowed: the CPU (model.to('cpu'), or model.runtime = 'eager')"
    if len(model.layers) != model.cfg.n_layers:
        return (
            f"a model with {len(model.layers)} layers where its config names n_layers={model.cfg.n_layers}; allowed: "
            "the layers its config names (or model.runtime = 'eager')"
        )
    return None


# Counts every parameter or submodule registered on any module (setattr, load_state_dict(assign=True), ...), so that a
# step can tell cheaply that what it read may be stale. Installed with the first ParameterWatch.
_registrations = 0
_hooks_installed = False


def _count_registration(*_) -> None:
    global _registrations
    _registrations += 1


def _install_hooks() -> None:
    global _hooks_installed
    if not _hooks_installed:
        module_hooks.register_module_module_registration_hook(_count_registration)
        module_hooks.register_module_parameter_registration_hook(_count_registration)
        _hooks_installed = True


class ParameterWatch:
    """Where each of ``model``'s parameters lies and, for a step that holds a copy of their values (``copies``), each
    one's version, as ``reset`` found them. ``stale()`` says whether any has moved (a cast or a move changes every
    address, ``.data =`` one), changed in place (under ``copies``), whether any module has registered a parameter or
    a submodule since (``load_state_dict(assign=True)``, a replaced layer), or a layer was deleted.

    ``versioned`` is False when ``copies`` was asked for but some parameter was made under inference mode, which keeps
    no version: then an edit in place cannot be seen, and the step must read the parameters where they are."""

    def __init__(self, model: nn.Module, copies: bool, buffers: tuple[str, ...] = ()) -> None:
        """``buffers``: names of buffers watched as parameters are (e.g. ``RMSNorm``'s ``_eps``)."""
        _install_hooks()
        self.model, self.copies, self.buffers = model, copies, buffers
        self.reset()

    def reset(self) -> None:
        """Take the parameters as they are now."""
        self.registrations = _registrations
        # Where each parameter is held: walking model.parameters() at every step took 0.1 ms, 1% of a step.
        modules = list(self.model.modules())
        self.holders = [(m._parameters, n) for m in modules for n, p in m._parameters.items() if p is not None]
        self.holders += [(m._buffers, n) for m in modules for n in self.buffers if m._buffers.get(n) is not None]
        self.addresses = self._addresses()
        self.versioned = self.copies and not any(holder[name].is_inference() for holder, name in self.holders)
        self.versions = self._versions()

    def ignore_registrations(self) -> None:
        """Registrations so far are the step's own (an exporter wraps the model in a module of its own)."""
        self.registrations = _registrations

    def _addresses(self) -> list[int]:
        # A parameter set to None (model.lm_head = None) registers nothing: its 0 differs from any address.
        return [0 if holder[name] is None else holder[name].data_ptr() for holder, name in self.holders]

    def _versions(self) -> list[int]:
        if not self.versioned:
            return []
        return [-1 if holder[name] is None else holder[name]._version for holder, name in self.holders]

    def stale(self) -> bool:
        """Checked at every step, so kept cheap: the checks before a compiled run find their code and data evicted by
        the previous run's weights, and cost several times what they cost in a loop of their own
        (docs/cpu_performance.md, section I)."""
        return (
            self.registrations != _registrations
            or len(self.model.layers) != self.model.cfg.n_layers
            or self._addresses() != self.addresses
            or self._versions() != self.versions
        )
