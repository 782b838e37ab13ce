"""SAEs spliced into vLLM's forward: SAELens's ``HookedSAETransformer.add_sae`` in a worker.

SAELens replaces the hook point of the SAE's ``hook_name`` with the SAE: the model computes on
with the SAE's output, and the SAE's own hook points (``hook_sae_input`` ... ``hook_sae_output``)
are names of the model. Here a :class:`Splice` runs at the site of that name, on the whole
step's rows, before the site serves any request: it reads the name's value, runs the SAE and
writes the output back through the name's write rule. Each of the SAE's hook points is an
identity module of the splice, attached under :data:`ROOT` of vLLM's model, whose output is an
ordinary site: its values are narrowed per request, cached, and handed to hook functions (which
may edit them, e.g. clamp a feature of ``hook_sae_acts_post``), as at any other name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from vlens.runtime.sites.torch_hooks import NarrowedCall
from vlens.runtime.vocabulary.readers import Reader

if TYPE_CHECKING:  # a worker loads vlens.sae only when it unpickles an SAE to splice in
    from vlens.sae.autoencoder import SAE

#: Where the splices hang in vLLM's module tree: ``ROOT.KEY.hook_sae_acts_post``.
ROOT = "vlens_saes"


def stage_path(key: str, stage: str) -> str:
    """The module path of one hook point of the SAE spliced in as ``key``."""
    return f"{ROOT}.{key}.{stage}"


class Splice(nn.Module):
    """One SAE at one name: its hook points as identity modules, and how to read and write the
    name it replaces."""

    def __init__(self, sae: SAE, read: Reader, use_error_term: bool) -> None:
        super().__init__()
        self.sae = sae
        self.read = read
        self.use_error_term = use_error_term
        for stage in sae.hook_names:
            self.add_module(stage, nn.Identity())

    def forward(self, x: Tensor) -> Tensor:
        """The SAE's output for ``x`` (``[tokens, ...]``), through its hook points."""
        return self.sae.run(x, self._visit, self.use_error_term)

    def _visit(self, stage: str, value: Tensor) -> Tensor:
        # The identity's forward hooks (vlens's sites) may edit the value in place: the input
        # must be the pass's own tensor, not a view of vLLM's buffers (every later stage is).
        if stage == "hook_sae_input":
            value = value.clone()
        return getattr(self, stage)(value)

    def apply(self, call: NarrowedCall) -> None:
        """Replace the name's value in this step (``call``, over every row) by the SAE's output."""
        value = self.read(call)
        self.read.write(call, self(value).to(value.dtype))


def splices_of(model: nn.Module) -> nn.ModuleDict:
    """The model's splices by key, attached under :data:`ROOT` on first need."""
    found: Any = getattr(model, ROOT, None)
    if found is None:
        found = nn.ModuleDict()
        model.add_module(ROOT, found)
    return found
