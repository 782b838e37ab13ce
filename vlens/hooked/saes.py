"""SAELens's ``HookedSAETransformer`` API on :class:`~vlens.hooked.model.HookedVLLM`.

``add_sae(sae)`` splices an SAE into the forward at its ``hook_name`` (the SAE's output replaces
the activation there, for every prompt of every later call, until :meth:`SAEMethods.reset_saes`),
and the SAE's hook points become names of the model: ``{hook_name}.hook_sae_input``,
``.hook_sae_acts_pre``, ``.hook_sae_acts_post``, ``.hook_sae_recons``, ``.hook_sae_error`` (with
the error term) and ``.hook_sae_output`` — readable in ``run_with_cache``, hookable like any name
(a hook on ``hook_sae_acts_post`` edits features). With ``use_error_term`` the output is the
reconstruction plus the error of a clean pass (``x − x̂_clean``), so that the model runs as
without the SAE until a feature is edited. The worker side is :mod:`vlens.runtime.sites.splices`.

One difference from SAELens: the spliced name itself stays a name (its value is the SAE's output,
what the model computes on), where SAELens replaces its hook point by the SAE.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

from vlens.engine.checkpoint import Checkpoint
from vlens.engine.engine import Engine
from vlens.hooked.hook_registry import HookRegistry
from vlens.names.compiled import sae_hook_name
from vlens.names.mapping import HookSpec, Site
from vlens.runtime.sites.splices import stage_path
from vlens.runtime.vocabulary.readers import OutputOf
from vlens.sae.autoencoder import HOOK_NAMES, SAE


@dataclass(frozen=True)
class Attached:
    """An SAE spliced in at ``name``, as ``key``, with the error term or not."""

    sae: SAE
    name: str
    key: str
    use_error_term: bool

    @property
    def names(self) -> list[str]:
        """The names of its hook points, in the order they run."""
        stages = [s for s in HOOK_NAMES if s != "hook_sae_error" or self.use_error_term]
        return [f"{self.name}.{stage}" for stage in stages]


class SAEMethods:
    """``add_sae``, ``reset_saes``, ``saes()``, ``run_with_saes``, ``run_with_cache_with_saes``
    and ``run_with_hooks_with_saes``, as SAELens's ``HookedSAETransformer`` has them."""

    checkpoint: Checkpoint
    engine: Engine
    registry: HookRegistry
    run_with_cache: Any
    run_with_hooks: Any
    remove_backward_hooks: Any
    _attached: dict[str, Attached]

    @property
    def acts_to_saes(self) -> dict[str, SAE]:
        """The SAEs spliced in, by the name each replaces."""
        return {name: attached.sae for name, attached in self._saes().items()}

    def _saes(self) -> dict[str, Attached]:
        if not hasattr(self, "_attached"):
            self._attached = {}
        return self._attached

    def add_sae(
        self,
        sae: SAE,
        use_error_term: bool | None = None,
        exclude_special_tokens: bool | list[int] = False,
    ) -> None:
        """Splice ``sae`` in at its ``hook_name`` for every later call, replacing an SAE already
        there; ``use_error_term`` None keeps the SAE's own setting."""
        sae = SAE.of(sae)  # SAELens's own SAE objects are taken as they are
        if exclude_special_tokens:
            raise NotImplementedError(
                "exclude_special_tokens: vlens splices the SAE in at every position; leave it "
                "False, or zero the features at special tokens with a hook on hook_sae_acts_post"
            )
        name = self._sae_name(sae)
        spec = self.checkpoint.hook_specs[name]
        error_term = sae.use_error_term if use_error_term is None else use_error_term
        if name in self._saes():
            self._detach(name)
        key = re.sub(r"\W", "_", name)
        attached = Attached(sae, name, key, error_term)
        self.engine.splice(key, spec.site, spec.read, sae, error_term)
        self._saes()[name] = attached
        self._add_sae_names(attached, spec)
        self.checkpoint.rules.spliced |= set(attached.names)

    def reset_saes(self, act_names: str | Sequence[str] | None = None) -> None:
        """Take out the SAEs at ``act_names`` (all when None); hooks added on their names go
        with them."""
        names = list(self._saes()) if act_names is None else act_names
        for name in [names] if isinstance(names, str) else names:
            if name not in self._saes():
                raise ValueError(
                    f"no SAE is spliced in at {name!r}; at: {', '.join(self._saes()) or '(none)'}"
                )
            self._detach(name)

    @contextmanager
    def saes(
        self,
        saes: SAE | Sequence[SAE] = (),
        reset_saes_end: bool = True,
        use_error_term: bool | None = None,
        exclude_special_tokens: bool | list[int] = False,
    ) -> Iterator[Any]:
        """``with model.saes(saes=[sae]):`` — SAEs for the calls in the block; at its end (with
        ``reset_saes_end``) they are taken out and the SAEs they replaced put back."""
        replaced: list[tuple[str, Attached | None]] = []
        try:
            for sae in [saes] if isinstance(saes, nn.Module) else saes:
                sae = SAE.of(sae)
                name = self._sae_name(sae)
                replaced.append((name, self._saes().get(name)))
                self.add_sae(sae, use_error_term, exclude_special_tokens)
            yield self
        finally:
            if reset_saes_end:
                for name, before in reversed(replaced):
                    if name in self._saes():
                        self._detach(name)
                    if before is not None:
                        self.add_sae(before.sae, before.use_error_term)

    def run_with_saes(
        self,
        *model_args: Any,
        saes: SAE | Sequence[SAE] = (),
        reset_saes_end: bool = True,
        use_error_term: bool | None = None,
        exclude_special_tokens: bool | list[int] = False,
        **model_kwargs: Any,
    ) -> Any:
        """``model(*model_args, **model_kwargs)`` with ``saes`` spliced in."""
        with self.saes(saes, reset_saes_end, use_error_term, exclude_special_tokens):
            return self(*model_args, **model_kwargs)

    def run_with_cache_with_saes(
        self,
        *model_args: Any,
        saes: SAE | Sequence[SAE] = (),
        reset_saes_end: bool = True,
        use_error_term: bool | None = None,
        exclude_special_tokens: bool | list[int] = False,
        **kwargs: Any,
    ) -> Any:
        """:meth:`run_with_cache` with ``saes`` spliced in: the cache holds their names too."""
        with self.saes(saes, reset_saes_end, use_error_term, exclude_special_tokens):
            return self.run_with_cache(*model_args, **kwargs)

    def run_with_hooks_with_saes(
        self,
        *model_args: Any,
        saes: SAE | Sequence[SAE] = (),
        reset_saes_end: bool = True,
        exclude_special_tokens: bool | list[int] = False,
        **kwargs: Any,
    ) -> Any:
        """:meth:`run_with_hooks` with ``saes`` spliced in."""
        with self.saes(saes, reset_saes_end, exclude_special_tokens=exclude_special_tokens):
            return self.run_with_hooks(*model_args, **kwargs)

    # ---- the names -----------------------------------------------------------------------------

    def _sae_name(self, sae: SAE) -> str:
        """The canonical name ``sae`` reads, checked to be one it can replace on this model."""
        checkpoint = self.checkpoint
        name = sae_hook_name(sae, checkpoint.hook_specs, checkpoint.hf_config, checkpoint.explain)
        if checkpoint.compiled is not None and name not in checkpoint.compiled.hooks:
            raise ValueError(
                f"an SAE at {name} on this compiled engine: an SAE runs in Python, and the "
                f"compiled graph calls into Python only at the names declared in compiled_hooks "
                f"when it was loaded; load it with compiled_hooks=[{name!r}] (or without "
                f"compiled_* arguments: vLLM's eager engine), or declare it in compiled_saes "
                f"to edit its features as data (SAESteer)"
            )
        return name

    def _add_sae_names(self, attached: Attached, spec: HookSpec) -> None:
        """Make the SAE's hook points names of the model, right after the name it replaces."""
        d_in, d_sae = attached.sae.cfg.d_in, attached.sae.cfg.d_sae
        shapes = {
            "hook_sae_input": f"pos {d_in}",
            "hook_sae_acts_pre": f"pos {d_sae}",
            "hook_sae_acts_post": f"pos {d_sae}",
            "hook_sae_recons": f"pos {d_in}",
            "hook_sae_error": spec.shape,
            "hook_sae_output": spec.shape,
        }
        added = {
            name: HookSpec(
                Site(stage_path(attached.key, name.rsplit(".", 1)[1]), "output"),
                OutputOf(),
                shapes[name.rsplit(".", 1)[1]],
            )
            for name in attached.names
        }
        self.checkpoint.add_names_after(attached.name, added)
        self._forget_views()

    def _detach(self, name: str) -> None:
        attached = self._saes().pop(name)
        checkpoint = self.checkpoint
        spec = checkpoint.hook_specs[name]
        self.engine.splice(attached.key, spec.site, spec.read, None, False)
        gone = set(attached.names)
        checkpoint.rules.spliced -= gone
        self.registry.added = [hook for hook in self.registry.added if hook.name not in gone]
        for stage_name in attached.names:
            self.remove_backward_hooks(stage_name, True)
        specs = {n: s for n, s in checkpoint.hook_specs.items() if n not in gone}
        checkpoint.set_names(specs, set(checkpoint.canonical_names) - gone)
        self._forget_views()

    def _forget_views(self) -> None:
        """The module-like views built over the names (:mod:`vlens.hooked.views`) are stale."""
        for cached in ("_hook_points", "_prefixes"):
            self.__dict__.pop(cached, None)
