"""The vocabulary that mapping files are written in.

A mapping file (``mappings/<arch>.py``) says, for each TransformerLens hook name, either *where*
its value lives in vLLM's module tree (a :class:`Site`) and *how* to turn what that module sees
into TransformerLens's value (a reader, :mod:`vlens.runtime.vocabulary.readers`) — a :class:`HookSpec`; or how to
compute it from other names once a request is complete (:mod:`vlens.names.derived`) — a
:class:`DerivedSpec`. The runtime knows nothing about architectures.

vLLM never forms attention scores, patterns or per-head results. A mapping that declares what
computing one layer's attention needs (:class:`ExplicitAttention`) lets hook functions run on
them: at the layers and for the requests that carry such hooks, the worker computes that layer's
attention itself (:mod:`vlens.runtime.attention.explicit`).

Names, paths, sources and weight names may contain ``{layer}``; :func:`expand_layers` makes one
entry per layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from vlens.names import derived
from vlens.names.weights import WeightNames
from vlens.runtime.vocabulary import readers
from vlens.runtime.vocabulary.locations import (
    Argument,
    AttentionStage,
    ExplicitAttention,
    Site,
    Split,
)
from vlens.runtime.vocabulary.locations import PartialSums as PartialSums  # for the mapping files
from vlens.runtime.vocabulary.locations import Shards as Shards  # for the mapping files
from vlens.runtime.vocabulary.readers import Reader


@dataclass(frozen=True)
class HookSpec:
    """A name read from one vLLM site. ``shape`` is its shape for one request, in jaxtyping words.

    Readers return rows first (``[pos, ...]``); ``arrange``, an einops pattern, reorders the padded
    batch where TransformerLens puts another axis first.
    """

    site: Site
    read: Reader
    shape: str
    arrange: str | None = None

    def for_layer(self, layer: int) -> HookSpec:
        return dataclasses.replace(self, site=self.site.for_layer(layer))


@dataclass(frozen=True)
class DerivedSpec:
    """A name computed in the user's process from ``sources`` (other names) over the whole batch.

    ``hookable``: how a hook function can run on it: the worker forms it where a hook needs it
    (:class:`ExplicitStage`); or not, with the architecture's reason (:class:`NoExplicitAttention`)
    or none (None): such a name is only read after the forward.
    """

    sources: tuple[str, ...]
    compute: derived.Compute
    shape: str
    hookable: ExplicitStage | NoExplicitAttention | None = dataclasses.field(
        default=None, kw_only=True
    )

    def for_layer(self, layer: int) -> DerivedSpec:
        sources = tuple(source.format(layer=layer) for source in self.sources)
        hookable = None if self.hookable is None else self.hookable.for_layer(layer)
        return DerivedSpec(sources, self.compute.for_layer(layer), self.shape, hookable=hookable)


# ---- attention computed in the worker, for hooks on scores, patterns and per-head results ------

@dataclass(frozen=True)
class ExplicitStage:
    """A derived name that the worker forms for real when a hook function is on it: ``stage`` of
    the explicitly computed ``attention``."""

    attention: ExplicitAttention
    stage: AttentionStage

    def for_layer(self, layer: int) -> ExplicitStage:
        return ExplicitStage(self.attention.for_layer(layer), self.stage)


@dataclass(frozen=True)
class NoExplicitAttention:
    """Why an architecture's attention cannot be computed explicitly in the worker (shown when a
    hook is added to its scores, pattern or per-head results)."""

    reason: str

    def for_layer(self, layer: int) -> NoExplicitAttention:
        return self


Explicit = ExplicitAttention | NoExplicitAttention | None


def _hookable(
    explicit: Explicit, stage: AttentionStage
) -> ExplicitStage | NoExplicitAttention | None:
    if isinstance(explicit, ExplicitAttention):
        return ExplicitStage(explicit, stage)
    return explicit


Spec = HookSpec | DerivedSpec


def per_sample(spec: Spec) -> bool:
    """Whether a name has a value per sampled token (the sampler's names), not per position."""
    return isinstance(spec, HookSpec) and spec.site.event == "sampled"


def site_sources(specs: dict[str, Spec], name: str) -> list[str]:
    """The names read from vLLM sites that ``name`` is (a site name) or is built from (a derived
    name, through its sources, recursively)."""
    spec = specs[name]
    if not isinstance(spec, DerivedSpec):
        return [name]
    return [site for source in spec.sources for site in site_sources(specs, source)]

# ---- helpers that mapping files read like the forward pass --------------------------------------


def leaving(
    path: str,
    element: int | None = None,
    plus: int | None = None,
    shape: str = "pos d_model",
    shards: Split | None = None,
) -> HookSpec:
    """The value a module returns (``element`` of a tuple; ``plus`` another element added;
    ``shards``: how it is split over tensor-parallel ranks, if it is)."""
    return HookSpec(Site(path, "output"), readers.OutputOf(element, plus, shards), shape)


def entering(
    path: str, argument: Argument, plus: Argument | None = None, shape: str = "pos d_model"
) -> HookSpec:
    """The value a module is called with (``plus`` another argument added when not None)."""
    return HookSpec(Site(path, "input"), readers.InputOf(argument, plus), shape)


def columns(of: HookSpec, start: int, stop: int, shape: str) -> HookSpec:
    """One part of a fused projection's output (``[q | k | v]``, ``[gate | up]``)."""
    return HookSpec(of.site, readers.Columns(of.read, start, stop), shape)


def per_head(of: HookSpec, d_head: int, heads: str = "head") -> HookSpec:
    """``[pos, heads·d_head]`` viewed as ``[pos, heads, d_head]``."""
    return HookSpec(of.site, readers.PerHead(of.read, d_head), f"pos {heads} d_head")


def repeated_per_head(of: HookSpec, heads: int, label: str = "head") -> HookSpec:
    """TransformerLens's per-head copies of a block input (``hook_attn_in``, ``hook_q_input``)."""
    return HookSpec(of.site, readers.RepeatPerHead(of.read, heads), f"pos {label} d_model")


def rms_scale(of: HookSpec, eps: float) -> HookSpec:
    return HookSpec(of.site, readers.RmsScale(of.read, eps), "pos 1")


def rms_normalized(of: HookSpec, eps: float) -> HookSpec:
    return HookSpec(of.site, readers.RmsNormalized(of.read, eps), of.shape)


def names_after(specs: dict[str, Spec], name: str, added: dict[str, Spec]) -> dict[str, Spec]:
    """``specs`` with ``added`` inserted right after ``name``, in forward order (a template's
    names, or a model's: an SAE's hook points after the name it replaces)."""
    order = list(specs.items())
    at = list(specs).index(name) + 1
    return dict(order[:at] + list(added.items()) + order[at:])


def logits(of: HookSpec) -> HookSpec:
    return HookSpec(of.site, readers.LogitsOf(of.read), "pos d_vocab")


def attention_scores(
    rot_q: str,
    rot_k: str,
    scale: float,
    explicit: Explicit = None,
    alibi: tuple[float, ...] | None = None,
) -> DerivedSpec:
    """``rot_q·rot_kᵀ·scale`` (plus ``alibi``, each head's ALiBi slope times the key's position,
    where given), causally masked; ``explicit``: how hooks on it can run (see
    :class:`DerivedSpec`), with the same ``scale`` and ``alibi``."""
    if isinstance(explicit, ExplicitAttention) and explicit.scale != scale:
        raise ValueError(f"explicit attention's scale {explicit.scale} is not the scores' {scale}")
    if isinstance(explicit, ExplicitAttention) and explicit.alibi != alibi:
        raise ValueError("explicit attention's ALiBi slopes are not the scores'")
    compute = derived.AttentionScores(scale, alibi=alibi)
    hookable = _hookable(explicit, "scores")
    return DerivedSpec((rot_q, rot_k), compute, "head query_pos key_pos", hookable=hookable)


def attention_pattern(scores: str, explicit: Explicit = None) -> DerivedSpec:
    hookable = _hookable(explicit, "pattern")
    return DerivedSpec((scores,), derived.Softmax(), "head query_pos key_pos", hookable=hookable)


def head_results(z: str, w_o: str, explicit: Explicit = None) -> DerivedSpec:
    """Per-head output after ``W_O``; ``w_o`` is the checkpoint's name of the output projection."""
    hookable = _hookable(explicit, "result")
    return DerivedSpec((z,), derived.HeadResults(w_o), "pos head d_model", hookable=hookable)


def heads_first(of: HookSpec, heads: str = "head") -> HookSpec:
    """A per-head ``[pos, head, d]`` value that TransformerLens keeps as ``[head, pos, d]``."""
    return dataclasses.replace(of, shape=f"{heads} pos d_head", arrange="b p h d -> b h p d")


def heads_in_rows(of: HookSpec, heads: int) -> HookSpec:
    """A per-head module's value read whether vLLM calls the module on ``[pos, heads, d_head]``
    or on ``[pos·heads, d_head]`` rows (:class:`~vlens.runtime.vocabulary.readers.HeadsInRows`)."""
    return dataclasses.replace(of, read=readers.HeadsInRows(of.read, heads))


def layer_norm_scale(of: HookSpec, eps: float) -> HookSpec:
    return HookSpec(of.site, readers.LayerNormScale(of.read, eps), "pos 1")


def layer_norm_normalized(of: HookSpec, eps: float) -> HookSpec:
    return HookSpec(of.site, readers.LayerNormNormalized(of.read, eps), of.shape)


def conv1d_head_results(z: str, *w_o: str, explicit: Explicit = None) -> DerivedSpec:
    """:func:`head_results` where the checkpoint stores the output projection as a Conv1D
    (``[H·d_head, d_model]``, GPT-2); ``w_o``: its possible names, the first one present is used."""
    compute = derived.Conv1DHeadResults(w_o)
    hookable = _hookable(explicit, "result")
    return DerivedSpec((z,), compute, "pos head d_model", hookable=hookable)


# ---- one architecture's mapping -----------------------------------------------------------------

#: The key of :attr:`ArchitectureMapping.not_offered` that keeps a GPU's default engine eager for
#: an architecture whose compiled engine is offered when its names are declared.
DEFAULT_GRAPH = "default_graph"


@dataclass(frozen=True)
class ArchitectureMapping:
    """The names of one architecture: ``hook_specs(config)`` returns them with ``{layer}`` templates.

    ``architectures`` are the HuggingFace class names (``config.architectures``) it serves. A
    mapping file (a module of the mappings package with a ``MAPPING``) is all an architecture
    needs: the package finds it, and so do the tests, the parity harness and the names table,
    through its ``tiny_configs`` and ``hf_recorder``. Another member of a family declares only
    what differs (:meth:`member`).
    """

    architectures: tuple[str, ...]
    hook_specs: Callable[[Any], dict[str, Spec]]
    #: The checkpoint's weights behind TransformerLens's analysis views; None where they do not
    #: apply (the analysis methods then say so).
    weights: WeightNames | None = dataclasses.field(default=None, kw_only=True)
    #: Whether the mapping marks every value vLLM splits over tensor-parallel ranks
    #: (:class:`Shards`), so that it serves engines with ``tensor_parallel_size > 1``.
    tensor_parallel: bool = dataclasses.field(default=False, kw_only=True)
    #: Whether every name has been checked to read the same traced into vLLM's compiled graph
    #: as in eager mode (:mod:`vlens.names.compiled`), so that compiled names are offered.
    compiled_graph: bool = dataclasses.field(default=False, kw_only=True)
    #: Why ``compiled_graph`` or ``tensor_parallel`` is off, by that field's name: what the
    #: architectures table says and what the refusal of such an engine tells the user; under
    #: :data:`DEFAULT_GRAPH`, why a GPU's default engine stays eager where ``compiled_graph`` is on.
    not_offered: Mapping[str, str] = dataclasses.field(default_factory=dict, kw_only=True)
    #: Why a name that looks plausible can never be given (e.g. one routed expert of a fused MoE
    #: kernel); None for names the architecture has nothing to say about.
    unavailable: Callable[[str], str | None] | None = dataclasses.field(default=None, kw_only=True)
    #: vLLM's ``model_impl`` that builds the module tree ``hook_specs`` names: ``"transformers"``
    #: for a mapping of vLLM's Transformers backend (HuggingFace's own modules), set for the user
    #: (a vLLM that also implements the architecture natively would otherwise build its tree).
    model_impl: Literal["auto", "transformers"] = dataclasses.field(default="auto", kw_only=True)
    #: Engine arguments this architecture needs on vLLM's CPU backend, unless the user sets them.
    cpu_engine_args: Mapping[str, Any] = dataclasses.field(default_factory=dict, kw_only=True)
    #: The same on CUDA (a vLLM kernel that fails the architecture there, avoided).
    cuda_engine_args: Mapping[str, Any] = dataclasses.field(default_factory=dict, kw_only=True)
    #: Its tiny random test checkpoints (:func:`vlens.testing.tiny.tiny_model`): a name → the function
    #: building that checkpoint's transformers config.
    tiny_configs: Mapping[str, Callable[[], Any]] = dataclasses.field(
        default_factory=dict, kw_only=True
    )
    #: The module of ``vlens.parity`` (``parity/<name>.py``) whose ``record(model, recorder)``
    #: reads HuggingFace's reference values for these architectures; None: no reference.
    hf_recorder: str | None = dataclasses.field(default=None, kw_only=True)
    #: Why TransformerLens's bridge gives no reference for these architectures (the parity suite
    #: then compares them with HuggingFace alone); None where it does.
    no_bridge_reference: str | None = dataclasses.field(default=None, kw_only=True)
    #: Why vLLM on CUDA cannot run the tiny checkpoints as they are (the GPU parity run leaves
    #: them out); None where it can.
    tiny_off_cuda: str | None = dataclasses.field(default=None, kw_only=True)

    def expanded(self, config: Any) -> dict[str, Spec]:
        return expand_layers(self.hook_specs(config), config.num_hidden_layers)

    def member(
        self,
        *architectures: str,
        tiny_configs: Mapping[str, Callable[[], Any]] | None = None,
        **differences: Any,
    ) -> ArchitectureMapping:
        """Another architecture of this family: this mapping for ``architectures``, with
        ``differences`` (other fields, e.g. its own ``hook_specs``). Test checkpoints are never
        inherited: ``tiny_configs`` are the member's own."""
        return dataclasses.replace(
            self, architectures=architectures, tiny_configs=dict(tiny_configs or {}), **differences
        )


def attention_dimensions(config: Any) -> tuple[int, int, int]:
    """Query heads, key/value heads and head size of a HuggingFace config (a config without
    ``head_dim`` splits ``hidden_size`` evenly over the query heads; Falcon's ``multi_query``
    outside its new decoder architecture means one key/value head)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", True):
        kv_heads = 1
    return heads, kv_heads, getattr(config, "head_dim", None) or config.hidden_size // heads


def inserted_before(specs: dict[str, Spec], name: str, new: dict[str, Spec]) -> dict[str, Spec]:
    """``specs`` with ``new`` placed right before ``name`` (the order names are listed in, as
    a family member adds names inside a block)."""
    items = list(specs.items())
    at = list(specs).index(name)
    return {**dict(items[:at]), **new, **dict(items[at:])}


def expand_layers(specs: dict[str, Spec], n_layers: int) -> dict[str, Spec]:
    """One entry per layer for every name that contains ``{layer}``, in forward order."""
    per_layer = {name: spec for name, spec in specs.items() if "{layer}" in name}
    before = {n: s for n, s in specs.items() if n not in per_layer and not _after_blocks(n)}
    after = {n: s for n, s in specs.items() if n not in per_layer and _after_blocks(n)}
    expanded: dict[str, Spec] = dict(before)
    for layer in range(n_layers):
        for name, spec in per_layer.items():
            expanded[name.format(layer=layer)] = spec.for_layer(layer)
    expanded.update(after)
    return expanded


def _after_blocks(name: str) -> bool:
    return name.startswith(("ln_final.", "unembed."))


# ---- multi-head latent attention and mixtures of experts (DeepSeek) -----------------------------


def squeezed(of: HookSpec, axis: int, shape: str) -> HookSpec:
    """``of`` without its size-1 ``axis``."""
    return HookSpec(of.site, readers.Squeezed(of.read, axis), shape)


def latent_keys(kv_latent: str, k_pe: str, kv_b_proj: str, heads: int, d_nope: int) -> DerivedSpec:
    """MLA's per-head keys ``[k_nope | k_pe]`` from the kv latent and the rope part of k;
    ``kv_b_proj`` is the checkpoint's name of the latent's up-projection."""
    compute = derived.LatentKeys(kv_b_proj, heads, d_nope)
    return DerivedSpec((kv_latent, k_pe), compute, "pos head qk_head_dim")


def latent_values(kv_latent: str, kv_b_proj: str, heads: int, d_nope: int) -> DerivedSpec:
    """MLA's per-head values from the kv latent (see :func:`latent_keys`)."""
    compute = derived.LatentValues(kv_b_proj, heads, d_nope)
    return DerivedSpec((kv_latent,), compute, "pos head v_head_dim")


def expert_weights(router_logits: str, router: derived.GroupedTopK) -> DerivedSpec:
    return DerivedSpec((router_logits,), derived.ExpertWeights(router), "pos top_k")


def expert_indices(router_logits: str, router: derived.GroupedTopK) -> DerivedSpec:
    return DerivedSpec((router_logits,), derived.ExpertIndices(router), "pos top_k")


def difference(whole: str, part: str, shape: str = "pos d_model") -> DerivedSpec:
    """``whole − part``: the other term of a sum whose total and one term vLLM exposes."""
    return DerivedSpec((whole, part), derived.Difference(), shape)


@dataclass(frozen=True)
class UnevenLayersMapping(ArchitectureMapping):
    """An architecture whose layers are not all alike (DeepSeek: a dense MLP below
    ``first_k_dense_replace``, a mixture of experts from there on): ``present(config, template,
    layer)`` says whether the ``{layer}`` name ``template`` exists at ``layer``."""

    present: Callable[[Any, str, int], bool]

    def expanded(self, config: Any) -> dict[str, Spec]:
        specs = self.hook_specs(config)
        n_layers = config.num_hidden_layers
        absent = {
            template.format(layer=layer)
            for template in specs
            if "{layer}" in template
            for layer in range(n_layers)
            if not self.present(config, template, layer)
        }
        expanded = expand_layers(specs, n_layers)
        return {name: spec for name, spec in expanded.items() if name not in absent}
