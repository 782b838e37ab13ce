"""Module-like access to a vlens model, as TransformerLens's ``TransformerBridge`` gives it.

vLLM's modules are not TransformerLens's, so these are views: ``model.blocks[3].attn`` holds that
block's weights in TransformerLens's layouts (read from the checkpoint, :mod:`vlens.names.weight_views`) and
its hook names as attributes, each a :class:`HookPointView` (``model.blocks[3].attn.hook_z``) whose
``add_hook`` / ``remove_hooks`` go through the model's own hook registry. Model-level weights are
stacked over layers (``model.W_Q``: ``[layer, head, d_model, d_head]``), and ``model.QK`` /
``model.OV`` are TransformerLens's ``FactoredMatrix``.

:class:`ModelViews` is mixed into a class that offers the :class:`~vlens.hooked.hook_points.HookedModel`
protocol.
"""

from __future__ import annotations

import inspect
from functools import cached_property
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor
from transformer_lens import FactoredMatrix

from vlens.hooked.hook_points import HookPointView
from vlens.hooked.hook_registry import HookRegistry
from vlens.hooked.weight_views import WeightViews
from vlens.names.weight_views import AttentionWeights, BlockWeights, MlpWeights, NormWeights


class HookNamespace:
    """The hook names under ``prefix`` as attributes: ``hook_z`` is ``{prefix}.hook_z``'s
    :class:`HookPointView`; a deeper prefix is another namespace."""

    def __init__(self, model: ModelViews, prefix: str) -> None:
        self._model = model
        self._prefix = prefix

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):
            raise AttributeError(attr)
        # A property that raised AttributeError (RMSNorm's ``b``) lands here: raise its own error.
        descriptor = inspect.getattr_static(type(self), attr, None)
        if isinstance(descriptor, (property, cached_property)):
            return descriptor.__get__(self, type(self))
        return self._model._view_at(f"{self._prefix}.{attr}")

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self._model._children(self._prefix)})

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._prefix!r})"


class NormView(NormWeights, HookNamespace):
    """``ln1``, ``ln2``, ``ln_final``: ``w`` (``b`` for LayerNorm), callable, and hook names."""

    def __init__(self, model: ModelViews, prefix: str, w: str, b: str, layer: int | None) -> None:
        NormWeights.__init__(self, model.checkpoint.analysis, w, b, layer)
        HookNamespace.__init__(self, model, prefix)


class AttentionView(AttentionWeights, HookNamespace):
    """``blocks[l].attn``: ``W_Q``... ``b_O`` and the block's ``attn.hook_*`` names."""

    def __init__(self, model: ModelViews, layer: int) -> None:
        AttentionWeights.__init__(self, model.checkpoint.analysis, layer)
        HookNamespace.__init__(self, model, f"blocks.{layer}.attn")


class MlpView(MlpWeights, HookNamespace):
    """``blocks[l].mlp``: ``W_in``, ``W_gate``, ``W_out``, biases and ``mlp.hook_*`` names."""

    def __init__(self, model: ModelViews, layer: int) -> None:
        MlpWeights.__init__(self, model.checkpoint.analysis, layer)
        HookNamespace.__init__(self, model, f"blocks.{layer}.mlp")


class BlockView(BlockWeights, HookNamespace):
    """``blocks[l]``: ``attn``, ``mlp``, ``ln1``, ``ln2`` and the block's hook names."""

    def __init__(self, model: ModelViews, layer: int) -> None:
        BlockWeights.__init__(self, model.checkpoint.analysis, layer)
        HookNamespace.__init__(self, model, f"blocks.{layer}")
        self._layer = layer

    @cached_property
    def attn(self) -> AttentionView:  # type: ignore[override]
        return AttentionView(self._model, self._layer)

    @cached_property
    def mlp(self) -> MlpView:  # type: ignore[override]
        return MlpView(self._model, self._layer)

    @cached_property
    def ln1(self) -> NormView:  # type: ignore[override]
        return NormView(self._model, f"{self._prefix}.ln1", "ln1_w", "ln1_b", self._layer)

    @cached_property
    def ln2(self) -> NormView:  # type: ignore[override]
        return NormView(self._model, f"{self._prefix}.ln2", "ln2_w", "ln2_b", self._layer)


class EmbedView(HookNamespace):
    @property
    def W_E(self) -> Float[Tensor, "d_vocab d_model"]:
        return self._model.checkpoint.analysis.require("W_E")


class PosEmbedView(HookNamespace):
    @property
    def W_pos(self) -> Float[Tensor, "n_ctx d_model"]:
        return self._model.checkpoint.analysis.require("W_pos")


class UnembedView(HookNamespace):
    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        return self._model.checkpoint.analysis.W_U

    @property
    def b_U(self) -> Float[Tensor, " d_vocab"]:
        return self._model.checkpoint.analysis.b_U


class ModelViews(WeightViews):
    """Mixed into :class:`~vlens.HookedVLLM` (in place of :class:`WeightViews`, which it
    extends): TransformerLens's module-like access and weight views (``model.blocks[3].attn.W_Q``,
    ``model.blocks[3].attn.hook_z``, ``model.W_E``, ``model.OV``, ``model.hook_dict``...)."""

    cfg: Any
    registry: HookRegistry
    hook_names: list[str]

    # ---- modules and hook points -------------------------------------------------------------

    @cached_property
    def blocks(self) -> list[BlockView]:  # type: ignore[override]
        return [BlockView(self, layer) for layer in range(self.cfg.n_layers)]

    @cached_property
    def embed(self) -> EmbedView:
        return EmbedView(self, "embed")

    @property
    def pos_embed(self) -> PosEmbedView:
        if self.cfg.positional_embedding_type != "standard":
            raise AttributeError(
                f"{self.cfg.architecture} has no learned positional embedding (pos_embed): its "
                f"positional_embedding_type is {self.cfg.positional_embedding_type!r}"
            )
        return self._pos_embed

    @cached_property
    def _pos_embed(self) -> PosEmbedView:
        return PosEmbedView(self, "pos_embed")

    @cached_property
    def unembed(self) -> UnembedView:
        return UnembedView(self, "unembed")

    @cached_property
    def ln_final(self) -> NormView:  # type: ignore[override]
        return NormView(self, "ln_final", "ln_final_w", "ln_final_b", None)

    @property
    def hook_embed(self) -> HookPointView:
        return self._view_at("hook_embed")

    @property
    def hook_pos_embed(self) -> HookPointView:
        return self._view_at("hook_pos_embed")

    @property
    def sampler(self) -> HookNamespace:
        return self._view_at("sampler")

    @property
    def hook_dict(self) -> dict[str, HookPointView]:
        """Every hook name (canonical) → its hook point view."""
        return dict(self._hook_points)

    @property
    def mod_dict(self) -> dict[str, Any]:
        """As TransformerLens's: every module path (``embed``, ``blocks``, ``blocks.0``,
        ``blocks.0.attn``, ..., ``unembed``) and every hook name → its view."""
        learned = self.cfg.positional_embedding_type == "standard"
        paths = ["embed", *(["pos_embed"] if learned else []), "blocks"]
        for layer in range(self.cfg.n_layers):
            block = f"blocks.{layer}"
            paths += [block] + [f"{block}.{part}" for part in ("ln1", "attn", "ln2", "mlp")]
        paths += ["ln_final", "unembed", *self._prefixes]
        modules = {path: self._resolve(path) for path in dict.fromkeys(paths)}
        return {**modules, **self._hook_points}

    @cached_property
    def _hook_points(self) -> dict[str, HookPointView]:
        return {name: HookPointView(self, name) for name in self.hook_names}

    @cached_property
    def _prefixes(self) -> dict[str, None]:
        """Every proper prefix of a hook name (``blocks.0.attn``, ``sampler``), in name order."""
        prefixes: dict[str, None] = {}
        for name in self.hook_names:
            parts = name.split(".")
            prefixes.update({".".join(parts[:end]): None for end in range(1, len(parts))})
        return prefixes

    def _children(self, prefix: str) -> set[str]:
        start = f"{prefix}."
        return {
            path[len(start) :].split(".")[0]
            for path in [*self._prefixes, *self._hook_points]
            if path.startswith(start)
        }

    def _view_at(self, path: str) -> Any:
        """The hook point view of a hook name, or the namespace of a prefix of hook names."""
        if path in self._hook_points:
            return self._hook_points[path]
        if path in self._prefixes:
            return HookNamespace(self, path)
        parent, _, attr = path.rpartition(".")
        where = f"{parent} of {self.cfg.architecture}" if parent else self.cfg.architecture
        raise AttributeError(f"{where} has no {attr!r}: no hook name starts with {path!r}")

    def _resolve(self, path: str) -> Any:
        """The object at a dotted path from the model (``blocks.0.attn``)."""
        target: Any = self
        for part in path.split("."):
            target = target[int(part)] if part.isdigit() else getattr(target, part)
        return target

    # ---- weights, stacked over layers ---------------------------------------------------------

    @property
    def W_E(self) -> Float[Tensor, "d_vocab d_model"]:
        return self.embed.W_E

    @property
    def W_pos(self) -> Float[Tensor, "n_ctx d_model"]:
        return self.pos_embed.W_pos

    @property
    def W_E_pos(self) -> Float[Tensor, "d_vocab_plus_n_ctx d_model"]:
        return torch.cat([self.W_E, self.W_pos], dim=0)

    def _stacked(self, part: str, attr: str) -> Tensor:
        tensors = [getattr(getattr(block, part), attr) for block in self.blocks]
        if any(tensor is None for tensor in tensors):
            raise AttributeError(
                f"{self.cfg.architecture} has no {part}.{attr} (bias-free projection): as "
                f"TransformerLens's bridge, no stacked {attr}; use zeros if an analysis needs one"
            )
        return torch.stack(tensors)

    @property
    def W_Q(self) -> Float[Tensor, "layer head d_model d_head"]:
        return self._stacked("attn", "W_Q")

    @property
    def W_K(self) -> Float[Tensor, "layer kv_head d_model d_head"]:
        return self._stacked("attn", "W_K")

    @property
    def W_V(self) -> Float[Tensor, "layer kv_head d_model d_head"]:
        return self._stacked("attn", "W_V")

    @property
    def b_Q(self) -> Float[Tensor, "layer head d_head"]:
        return self._stacked("attn", "b_Q")

    @property
    def b_K(self) -> Float[Tensor, "layer kv_head d_head"]:
        return self._stacked("attn", "b_K")

    @property
    def b_V(self) -> Float[Tensor, "layer kv_head d_head"]:
        return self._stacked("attn", "b_V")

    @property
    def b_O(self) -> Float[Tensor, "layer d_model"]:
        return self._stacked("attn", "b_O")

    @property
    def W_in(self) -> Float[Tensor, "layer d_model d_mlp"]:
        return self._stacked("mlp", "W_in")

    @property
    def W_gate(self) -> Float[Tensor, "layer d_model d_mlp"] | None:
        """None for an ungated MLP, as TransformerLens's bridge."""
        return None if self.checkpoint.analysis.names.W_gate is None else self._stacked("mlp", "W_gate")

    @property
    def b_in(self) -> Float[Tensor, "layer d_mlp"]:
        return self._stacked("mlp", "b_in")

    @property
    def b_out(self) -> Float[Tensor, "layer d_model"]:
        return self._stacked("mlp", "b_out")

    def _per_query_head(self, tensor: Tensor, dim: int) -> Tensor:
        """Grouped keys or values repeated to one per query head (query head h reads kv head
        h // group), as TransformerLens does for circuits."""
        return tensor.repeat_interleave(self.cfg.n_heads // tensor.shape[dim], dim=dim)

    @property
    def QK(self) -> FactoredMatrix:
        """``W_Q @ W_K^T`` per layer and head, ``[layer, head, d_model, d_model]``, factored."""
        return FactoredMatrix(self.W_Q, self._per_query_head(self.W_K, 1).transpose(-2, -1))

    @property
    def OV(self) -> FactoredMatrix:
        """``W_V @ W_O`` per layer and head, ``[layer, head, d_model, d_model]``, factored."""
        return FactoredMatrix(self._per_query_head(self.W_V, 1), self.W_O)

    def tl_parameters(self) -> dict[str, Tensor]:
        """TransformerLens's parameter dictionary (the bridge's ``tl_parameters``): names such as
        ``blocks.0.attn.W_Q``; keys and values repeated to every query head; absent biases as
        zeros; norm weights as the checkpoint has them."""
        cfg = self.cfg
        dtype = self.W_E.dtype
        zeros = lambda *shape: torch.zeros(*shape, dtype=dtype)  # noqa: E731
        params = {"embed.W_E": self.W_E}
        if cfg.positional_embedding_type == "standard":
            params["pos_embed.W_pos"] = self.W_pos
        for layer, block in enumerate(self.blocks):
            attn, mlp, at = block.attn, block.mlp, f"blocks.{layer}"
            params[f"{at}.attn.W_Q"] = attn.W_Q
            params[f"{at}.attn.W_K"] = self._per_query_head(attn.W_K, 0)
            params[f"{at}.attn.W_V"] = self._per_query_head(attn.W_V, 0)
            params[f"{at}.attn.W_O"] = attn.W_O
            for name in ("b_Q", "b_K", "b_V"):
                bias = getattr(attn, name)
                bias = zeros(cfg.n_heads, cfg.d_head) if bias is None else bias
                params[f"{at}.attn.{name}"] = self._per_query_head(bias, 0)
            params[f"{at}.attn.b_O"] = _or(attn.b_O, zeros(cfg.d_model))
            params[f"{at}.mlp.W_in"] = mlp.W_in
            params[f"{at}.mlp.W_out"] = mlp.W_out
            params[f"{at}.mlp.b_in"] = _or(mlp.b_in, zeros(mlp.W_in.shape[1]))
            params[f"{at}.mlp.b_out"] = _or(mlp.b_out, zeros(cfg.d_model))
            if mlp.W_gate is not None:
                params[f"{at}.mlp.W_gate"] = mlp.W_gate
            for name in ("ln1", "ln2"):
                if getattr(self.checkpoint.analysis.names, f"{name}_w") is not None:  # OLMo-2: post-norms
                    params.update(_norm_params(f"{at}.{name}", getattr(block, name)))
        params.update(_norm_params("ln_final", self.ln_final))
        params["unembed.W_U"] = self.W_U
        params["unembed.b_U"] = self.b_U
        return params

    def tl_named_parameters(self) -> Any:
        """``tl_parameters()`` as an iterator of ``(name, tensor)``."""
        return iter(self.tl_parameters().items())


def _or(tensor: Tensor | None, default: Tensor) -> Tensor:
    return default if tensor is None else tensor


def _norm_params(prefix: str, norm: NormWeights) -> dict[str, Tensor]:
    params = {f"{prefix}.w": norm.w}
    bias = getattr(norm, "b", None)  # RMSNorm has none
    if bias is not None:
        params[f"{prefix}.b"] = bias
    return params
