"""What the mixture-of-experts mappings share (``deepseek.py``, ``qwen3_moe.py``, ``mixtral.py``,
``olmoe.py``, ``qwen2_moe.py``): the routing names, their recomputation by vLLM's router, the
refusal of one routed expert's names, and which layers are MoE layers. (A module whose name starts
with ``_`` is not a mapping file: the registry skips it.)

vLLM runs every MoE block here the same way::

    router_logits, _ = gate(hidden)          # mlp.hook_router_logits [pos, n_routed_experts]
    out = experts(hidden, router_logits)     # one fused kernel: routing, every expert and the
                                             #   weighted sum (some families first run ``gate``
                                             #   inside it: still the module, still hooked)

``mlp.hook_expert_weights`` / ``mlp.hook_expert_indices`` (``[pos, top_k]``) are the routing vLLM
applies, recomputed from the router logits by the formula vLLM's CPU router uses for the family
(:class:`SoftmaxTopK` or DeepSeek's :class:`~vlens.names.derived.GroupedTopK`), best expert first. No
single routed expert's activations exist: :class:`RoutedExpertRefusal` says so.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxtyping import Float
from torch import Tensor

from vlens.mappings.llama import BLOCK, windowed_name_error
from vlens.names.derived import Batch, GroupedTopK, SameForEveryLayer
from vlens.names.mapping import (
    ArchitectureMapping,
    HookSpec,
    Spec,
    UnevenLayersMapping,
    expert_indices,
    expert_weights,
    leaving,
)
from vlens.names.weights import WeightNames
from vlens.runtime.vocabulary.locations import SiteCall
from vlens.runtime.vocabulary.readers import Reader

#: The dense gated MLP's names, which a MoE layer replaces.
DENSE_MLP_NAMES = tuple(f"{BLOCK}.mlp.hook_{n}" for n in ("pre", "pre_linear", "post"))
ROUTER_LOGITS = f"{BLOCK}.mlp.hook_router_logits"
ROUTING_NAMES = (
    ROUTER_LOGITS,
    f"{BLOCK}.mlp.hook_expert_weights",
    f"{BLOCK}.mlp.hook_expert_indices",
)


@dataclass(frozen=True)
class SoftmaxTopK(SameForEveryLayer):
    """vLLM's CPU router without expert groups (``_softmax_topk``): the ``top_k`` largest router
    logits choose the experts; their weights are the softmax over those ``top_k`` logits where
    ``renormalize`` (``norm_topk_prob``), else each one's softmax probability over all experts
    (``exp(logit − logsumexp)``). As in vLLM, computed in the logits' own dtype and returned in
    float32. Equal to HuggingFace's softmax-then-top-k (then renormalize) up to rounding."""

    top_k: int
    renormalize: bool

    def __call__(
        self, logits: Float[Tensor, "b pos expert"], batch: Batch
    ) -> tuple[Float[Tensor, "b pos top_k"], Tensor]:
        """Weights and (int64) indices, ``[b, pos, top_k]`` each, best first, zero at padding."""
        top_logits, indices = logits.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = top_logits.softmax(dim=-1)
        else:
            weights = (top_logits - logits.logsumexp(dim=-1, keepdim=True)).exp()
        padding = ~batch.mask[..., None]
        return weights.float().masked_fill(padding, 0.0), indices.masked_fill(padding, 0)


Router = GroupedTopK | SoftmaxTopK


@dataclass(frozen=True)
class Sigmoid:
    """A reader's value through a sigmoid (a gate's weight from its logit); read only."""

    source: Reader

    def __call__(self, call: SiteCall) -> Tensor:
        return self.source(call).sigmoid()


def sigmoid(of: HookSpec) -> HookSpec:
    return HookSpec(of.site, Sigmoid(of.read), of.shape)


def routing_specs(moe: str, router: Router) -> dict[str, Spec]:
    """The routing names of the MoE block at module path ``moe`` (its router is ``moe.gate``)."""
    logits = leaving(f"{moe}.gate", element=0, shape="pos n_routed_experts")
    return {
        ROUTER_LOGITS: logits,
        ROUTING_NAMES[1]: expert_weights(ROUTER_LOGITS, router),
        ROUTING_NAMES[2]: expert_indices(ROUTER_LOGITS, router),
    }


def with_experts(
    specs: dict[str, Spec], moe: str, router: Router, keep_dense: bool = False
) -> dict[str, Spec]:
    """A dense family's ``specs`` with the MoE block at ``moe`` as its MLP: the routing names
    where the dense MLP's names were and ``hook_mlp_out`` leaving ``moe``. ``keep_dense``: the
    dense names stay too, for an architecture whose layers are not all MoE layers (the mapping
    then says which are, :class:`MoeLayers`)."""
    out: dict[str, Spec] = {}
    for name, spec in specs.items():
        if name == DENSE_MLP_NAMES[0]:
            out.update(routing_specs(moe, router))
        if name not in DENSE_MLP_NAMES or keep_dense:
            out[name] = spec
    out[f"{BLOCK}.hook_mlp_out"] = leaving(moe)
    return out


@dataclass(frozen=True)
class MoeLayers:
    """Which ``{layer}`` names exist at a layer (:class:`~vlens.names.mapping.UnevenLayersMapping`'s
    ``present``) where some layers have a dense MLP and the others a MoE block:
    ``is_moe_layer(config, layer)`` is vLLM's rule; ``moe_names`` exist on MoE layers only, the
    dense MLP's names on the other layers only."""

    is_moe_layer: Callable[[Any, int], bool]
    moe_names: tuple[str, ...]

    def __call__(self, config: Any, template: str, layer: int) -> bool:
        if template in DENSE_MLP_NAMES:
            return not self.is_moe_layer(config, layer)
        if template in self.moe_names:
            return self.is_moe_layer(config, layer)
        return True


def uneven_member(
    family: ArchitectureMapping, *architectures: str, present: MoeLayers, **differences: Any
) -> UnevenLayersMapping:
    """:meth:`~vlens.names.mapping.ArchitectureMapping.member` for a member whose layers are not all
    alike (see :class:`MoeLayers`)."""
    member = family.member(*architectures, **differences)
    fields = {field.name: getattr(member, field.name) for field in dataclasses.fields(member)}
    return UnevenLayersMapping(**fields, present=present)


@dataclass(frozen=True)
class RoutedExpertRefusal:
    """Why a name cannot be given if it asks for one routed expert (any name with an
    ``experts.`` part, e.g. ``blocks.1.mlp.experts.3.hook_post``); None for any other name.
    ``offered``: the ``{layer}`` names a MoE layer has instead (``blocks.{layer}....``)."""

    offered: tuple[str, ...]

    def __call__(self, name: str) -> str | None:
        if not re.search(r"(^|\.)experts\.", name):
            return None
        layer = re.match(r"blocks\.(\d+)\.", name)
        block = f"blocks.{layer.group(1)}" if layer else BLOCK
        offered = ", ".join(n.replace(BLOCK, block) for n in self.offered)
        return (
            f"{name!r}: vLLM runs a MoE layer's routed experts as one fused kernel (routing, "
            f"every expert, the weighted sum), so no single expert's activations exist to hook. "
            f"Per MoE layer vlens offers {offered}."
        )


@dataclass(frozen=True)
class FirstReason:
    """The first reason any of ``checks`` gives for refusing a name (an ``unavailable`` made of
    several), or None."""

    checks: tuple[Callable[[str], str | None], ...]

    def __call__(self, name: str) -> str | None:
        return next((reason for check in self.checks if (reason := check(name))), None)


def moe_member(
    family: ArchitectureMapping,
    architecture: str,
    *,
    hook_specs: Callable[[Any], dict[str, Spec]],
    tiny_configs: dict[str, Callable[[], Any]],
    moe_names: tuple[str, ...] = ROUTING_NAMES,
    is_moe_layer: Callable[[Any, int], bool] | None = None,
    tensor_parallel: bool = True,
) -> ArchitectureMapping:
    """A dense family's member whose MLPs are mixtures of experts (``moe_names`` on MoE layers):
    the family's weights without the MLP's, the compiled engine (every name reads the same traced as
    eager: ``tests/engine/test_compiled.py``), the family's tensor parallelism unless
    ``tensor_parallel`` is False (vLLM reduces a MoE block's output over ranks inside the block,
    so the routing names and ``hook_mlp_out`` are whole on every rank; the attention's split
    values are the family's: ``tests/engine/test_tensor_parallel.py``), a routed
    expert's names refused (and the family's windowed names), HuggingFace's reference from
    ``parity/hf_moe.py``. With ``is_moe_layer`` only the layers it picks are MoE layers
    (:class:`MoeLayers`); the others keep the dense MLP."""
    differences = dict(
        hook_specs=hook_specs,
        weights=moe_weights(family.weights),
        tensor_parallel=tensor_parallel,
        compiled_graph=True,
        unavailable=FirstReason(
            (RoutedExpertRefusal((*moe_names, f"{BLOCK}.hook_mlp_out")), windowed_name_error)
        ),
        tiny_configs=tiny_configs,
        hf_recorder="hf_moe",
        no_bridge_reference=BRIDGE_ROUTING_LAYOUT,
    )
    if is_moe_layer is None:
        return family.member(architecture, **differences)
    return uneven_member(
        family, architecture, present=MoeLayers(is_moe_layer, moe_names), **differences
    )


def moe_weights(weights: WeightNames) -> WeightNames:
    """A dense family's weight names without the MLP's: a MoE layer has no single ``W_in``,
    ``W_gate`` or ``W_out`` (those views say so)."""
    return dataclasses.replace(weights, W_in=None, b_in=None, W_gate=None, W_out=None, b_out=None)


#: Why the parity suite does not compare these MoE families with TransformerLens's bridge
#: (``tests/engine/test_moe.py`` compares every other name with it).
BRIDGE_ROUTING_LAYOUT = (
    "TransformerLens's bridge boots, but its routing hooks (mlp.hook_expert_weights, "
    "mlp.hook_expert_indices) hold [tokens, ...] without a batch axis, and its expert weights "
    "scattered over all experts ([tokens, n_experts]), where vlens's routing names are "
    "DeepSeek's ([pos, top_k], best expert first); tests/engine/test_moe.py compares every other name "
    "with the bridge"
)
