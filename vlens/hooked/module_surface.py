"""The ``nn.Module`` calls TransformerLens code makes on its model (``model.eval()``,
``model.to(device)``, ``model.cuda()``, ``model.requires_grad_(False)``), answered for a vLLM
engine: it only runs inference, and its weights stay on the device and in the dtype it was built
with. What already holds returns the model, as ``nn.Module`` does; anything else is refused with
what to do instead, never silently ignored.
"""

from __future__ import annotations

from typing import Any

import torch


class ModuleSurface:
    """Mixed into :class:`vlens.HookedVLLM` (which provides ``engine``)."""

    engine: Any

    #: never in training mode: vLLM has no dropout to turn on and no backward pass
    training = False

    def eval(self) -> ModuleSurface:
        return self

    def train(self, mode: bool = True) -> ModuleSurface:
        if mode:
            refuse_gradients("train()")
        return self

    def requires_grad_(self, requires_grad: bool = True) -> ModuleSurface:
        if requires_grad:
            refuse_gradients("requires_grad_(True)")
        return self

    def to(self, device_or_dtype: str | torch.device | torch.dtype | None = None,
           print_details: bool = True) -> ModuleSurface:
        """TransformerLens's ``to`` (``print_details`` only says whether it prints the move):
        the model, where the engine already runs on ``device_or_dtype`` (a device or a dtype);
        otherwise refused, since vLLM fixes both when it builds the engine. Values still come
        back on ``cfg.device`` (the CPU), or where a call's ``device=`` says."""
        if isinstance(device_or_dtype, torch.dtype):
            dtype = self.engine.llm.model_config.dtype
            if device_or_dtype != dtype:
                raise ValueError(
                    f"to({device_or_dtype}): this engine's weights are {dtype}, fixed when vLLM "
                    f"built it; load the model with HookedVLLM.from_pretrained(path, "
                    f"dtype={str(device_or_dtype).removeprefix('torch.')!r})"
                )
            return self
        if device_or_dtype is not None:
            engine = self.engine_device_type()
            if torch.device(device_or_dtype).type != engine:
                raise ValueError(
                    f"to({str(device_or_dtype)!r}): this engine runs on {engine!r}, where vLLM "
                    f"built it, and its weights cannot move; values come back on the CPU "
                    f"(move them with tensor.to(...)), or pass device=... to run_with_cache; "
                    f"for another device build the model there"
                )
        return self

    def cuda(self, device: int | str | torch.device | None = None) -> ModuleSurface:
        if device is None or isinstance(device, int):
            return self.to(torch.device("cuda", device))
        return self.to(device)

    def cpu(self) -> ModuleSurface:
        return self.to("cpu")

    def engine_device_type(self) -> str:
        """Where vLLM runs the model: ``"cuda"``, ``"cpu"``, ..."""
        return str(self.engine.llm.llm_engine.vllm_config.device_config.device_type)


def refuse_gradients(what: str) -> None:
    """vLLM computes no gradients: say where gradient work runs instead."""
    raise NotImplementedError(
        f"{what}: vLLM runs inference only, and vlens's model has no trainable weights. "
        f"Gradients run on the model's gradient twin: register a backward hook "
        f"(add_hook(name, fn, dir='bwd')) and the forwards that follow compute gradients, or "
        f"run_with_cache(..., incl_bwd=True); model.gradient_twin() is TransformerLens's own "
        f"model of this checkpoint"
    )
