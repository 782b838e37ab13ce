"""Which modules of vLLM's tree really run as modules, and in which phase.

A raw location (``model.layers.3.mlp.act_fn.output``) only works on a module whose forward
hooks fire. Some never do: the top-level model, whose ``__call__`` vLLM replaces; ``lm_head``,
whose weight the logits processor applies directly; MLA's ``kv_b_proj`` in decode steps, where
vLLM absorbs it into the attention kernel. Rather than list them, vlens watches one short
generation (a prefill and a decode step) with a global forward hook and records what ran.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from vlens.runtime.steps.layout import RequestRows
from vlens.runtime.transfer.messages import ModuleRecord


def forward_parameters(module: nn.Module) -> tuple[str, ...]:
    """The names of ``forward``'s named parameters, in order (none for ``*args`` forwards)."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    signature = inspect.signature(module.forward)
    return tuple(name for name, p in signature.parameters.items() if p.kind in kinds)


class ModuleProbe:
    """A global forward hook recording every module call of the watched steps."""

    def __init__(self, model: nn.Module) -> None:
        self.by_id: dict[int, ModuleRecord] = {}
        for path, module in model.named_modules(remove_duplicate=False):
            if not path:
                continue
            if id(module) not in self.by_id:
                self.by_id[id(module)] = ModuleRecord(
                    type(module).__name__, [], forward_parameters(module)
                )
            self.by_id[id(module)].paths.append(path)
        self.handle: Any = None

    def start(self, layout_of_step) -> None:
        def watch(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            record = self.by_id.get(id(module))
            layout: list[RequestRows] | None = layout_of_step()
            if record is None or not layout:
                return
            rows = layout[0]
            record.phases.add("prefill" if rows.is_prefill else "decode")
            record.positional = max(record.positional, len(args))
            record.keywords = tuple(sorted({*record.keywords, *kwargs}))
            named = [
                (record.parameters[i] if i < len(record.parameters) else str(i), value)
                for i, value in enumerate(args)
            ]
            record.tensors.update(
                label for label, value in [*named, *kwargs.items()] if isinstance(value, Tensor)
            )
            first = output[0] if isinstance(output, tuple) and output else output
            if isinstance(first, Tensor) and (first.dim() == 0 or first.shape[0] != rows.stop):
                record.token_major = False

        self.handle = torch.nn.modules.module.register_module_forward_hook(watch, with_kwargs=True)

    def stop(self) -> dict[str, ModuleRecord]:
        """Every path of the tree → its record (shared modules have several paths)."""
        self.handle.remove()
        return {path: record for record in self.by_id.values() for path in record.paths}
