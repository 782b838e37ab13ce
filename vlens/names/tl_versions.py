"""TransformerLens 3 (the line SAELens pins) and 4 side by side: the helpers vlens takes from
TransformerLens moved from ``transformer_lens.utils`` (3) to ``transformer_lens.utilities`` (4),
and only 4 has the ``TransformerBridge``, whose other spellings of the names vlens accepts."""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import version
from types import ModuleType

#: TransformerLens's major version.
MAJOR = int(version("transformer-lens").split(".")[0])

#: Whether TransformerLens's ``TransformerBridge`` (and its names) exists.
HAS_BRIDGE = MAJOR >= 4


def _helpers() -> ModuleType:
    for name in ("transformer_lens.utilities", "transformer_lens.utils"):
        try:
            module = import_module(name)
        except ImportError:
            continue
        if hasattr(module, "get_act_name"):  # TransformerLens 3's utilities/ holds other things
            return module
    raise ImportError("TransformerLens has neither utilities.get_act_name nor utils.get_act_name")


helpers = _helpers()
get_act_name = helpers.get_act_name
lm_cross_entropy_loss = helpers.lm_cross_entropy_loss
Slice = helpers.Slice
SliceInput = helpers.SliceInput
