"""Architectures vLLM runs through its Transformers backend (``TransformersForCausalLM``), in
TransformerLens names, from TransformerLens's own adapter for the architecture.

On this backend vLLM builds HuggingFace's module tree itself (``AutoModel.from_config``, the
decoder model at ``model``), swapping parts for its own: ``nn.Linear`` for its parallel linears
(returning a tensor, no bias tuple), vocabulary embeddings and ``nn.LayerNorm`` for its own,
separate ``q_proj``/``k_proj``/``v_proj`` fused into ``qkv_proj`` (the attention's forward
rewritten to split it), gate and up projections into ``gate_up_proj`` with the activation fused
(``act_fn``), RMSNorms for its ``RMSNorm``. HuggingFace's attention calls the attention
interface, which hands the rotated q and k to vLLM's ``attn`` through its ``forward`` method, so
torch hooks on ``attn`` never fire. Every HuggingFace module runs on a batch of one,
``[1, tokens, ...]``; every read goes through :class:`~vlens.runtime.vocabulary.readers.BatchOfOne`.

Which HuggingFace module is which TransformerLens component comes from TransformerLens's adapter
(``component_mapping``: embed, blocks, ln1/ln2 or the post-norms ln1_post/ln2_post, attn with
q/k/v or a joint qkv and o, q_norm/k_norm, mlp with in/out and gate, ln_final), read by
:func:`layout_of`; an architecture's file gives only what the adapter does not say
(:class:`Details`: how a joint qkv is split, the config's eps field). The names, per block::

    hook_resid_pre      the block's input (hook_attn_in, hook_q/k/v_input: per-head copies)
    ln1.hook_scale/...  from ln1's input, by its kind (LayerNorm or RMSNorm)
    attn.hook_q/k/v     columns of qkv_proj (fused q/k/v) or of the joint qkv, per head
    attn.hook_q_normed  q_norm's output, over the whole projection (OLMo-2), as k_normed
    attn.hook_rot_q/k   q and k (normed where normed) through HuggingFace's own rotary
                        function and embedding, over each whole sequence: read only
    attn.hook_attn_scores/pattern   from rot_q, rot_k and the attention's scale
    attn.hook_z         the output projection's input; hook_result: z through its weight
    hook_attn_out       the attention's output (ln1_post's output where there is one)
    hook_resid_mid      ln2's input (the MLP's where there is no ln2); none in parallel blocks
    hook_mlp_in         ln2's input (the MLP's where there is no ln2); none where a parallel
                        block's MLP reads ln1's output (Phi), as in TransformerLens
    mlp.hook_pre(_linear)/hook_post  the MLP's input projection(s), the output projection's input
    hook_mlp_out        the MLP's output (ln2_post's output where there is one)
    hook_resid_post     the block's output

Under tensor parallelism vLLM splits the fused q/k/v (or the joint qkv, each rank its heads),
``q_norm``/``k_norm``'s outputs, ``o_proj``'s input and the MLP's hidden units over the ranks
(column-parallel in, row-parallel out, as HuggingFace's ``base_model_tp_plan`` says); the
mapping marks each (:class:`~vlens.names.mapping.Shards`), and the block's outputs are whole.

Rotated q and k are computed, not read: the attention interface's arguments are the only place
they exist, and hooks cannot reach it. Scores, patterns and per-head results can be read, and
no hook function runs on them (:class:`~vlens.names.mapping.NoExplicitAttention`). A config with a
sliding window shorter than its context offers no scores or patterns (as in ``llama.py``).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any, Literal

from transformers import PretrainedConfig

from vlens.mappings._rotary import rotated
from vlens.mappings._tiny import architecture_of
from vlens.mappings.llama import sliding_window, windowed_name_error
from vlens.names.mapping import (
    DEFAULT_GRAPH,
    ArchitectureMapping,
    Argument,
    HookSpec,
    NoExplicitAttention,
    Shards,
    Site,
    Spec,
    attention_dimensions,
    attention_pattern,
    attention_scores,
    head_results,
    logits,
)
from vlens.runtime.vocabulary import readers
from vlens.runtime.vocabulary.locations import Split

BLOCK = "blocks.{layer}"
#: Where vLLM's Transformers backend puts HuggingFace's decoder model.
VLLM_BASE = "model"
#: The modules vLLM's fusers make of HuggingFace's separate projections.
FUSED_QKV, FUSED_GATE_UP = "qkv_proj", "gate_up_proj"

NO_EXPLICIT = NoExplicitAttention(
    "vLLM's Transformers backend calls its attention kernel from HuggingFace's attention "
    "interface, where vlens cannot compute it instead; hook attn.hook_z or attn.hook_q/k/v"
)


@dataclass(frozen=True)
class Layout:
    """HuggingFace's module paths of one architecture, as TransformerLens's adapter names them:
    ``base`` the decoder model's attribute in the checkpoint (``gpt_neox``, ``model``), the rest
    relative to it (``embed``, ``layers``, ``ln_final``) or to one layer (the others)."""

    base: str
    embed: str
    layers: str
    ln_final: str
    norm: Literal["LN", "RMS"]
    attn: str
    o: str
    mlp: str
    mlp_in: str
    mlp_out: str
    ln1: str | None = None
    ln2: str | None = None
    ln1_post: str | None = None
    ln2_post: str | None = None
    q: str | None = None
    k: str | None = None
    v: str | None = None
    qkv: str | None = None
    q_norm: str | None = None
    k_norm: str | None = None
    mlp_gate: str | None = None
    parallel: bool = False


@dataclass(frozen=True)
class Details:
    """What TransformerLens's adapter does not say about an architecture.

    ``joint_qkv``: how a joint qkv projection's output is laid out: ``"per_head"``, each head's
    ``[q | k | v]`` side by side (GPT-NeoX).
    ``eps``: the config field holding the norms' epsilon, or the epsilon where HuggingFace fixes
    it (OLMo's parameter-free LayerNorm)."""

    eps: str | float
    joint_qkv: Literal["per_head"] | None = None


#: Each architecture's :class:`Details`, as its mapping file declared them.
DETAILS: dict[str, Details] = {}


def layout_of(config: PretrainedConfig) -> Layout:
    """The :class:`Layout` that TransformerLens's adapter for ``config``'s architecture declares."""
    components = adapter_components(config)
    blocks = components["blocks"]
    block, attn, mlp = blocks.submodules, blocks.submodules["attn"], blocks.submodules["mlp"]
    base, embed = components["embed"].name.split(".", 1)
    norm_bridge = type(components["ln_final"]).__name__
    names = {key: bridge.name for key, bridge in attn.submodules.items()}
    mlp_names = {key: bridge.name for key, bridge in mlp.submodules.items()}
    return Layout(
        base=base,
        embed=embed,
        layers=blocks.name.removeprefix(f"{base}."),
        ln_final=components["ln_final"].name.removeprefix(f"{base}."),
        norm="RMS" if norm_bridge.startswith("RMS") else "LN",
        attn=attn.name,
        o=names["o"],
        mlp=mlp.name,
        mlp_in=mlp_names["in"],
        mlp_out=mlp_names["out"],
        ln1=_name(block.get("ln1")),
        ln2=_name(block.get("ln2")),
        ln1_post=_name(block.get("ln1_post")),
        ln2_post=_name(block.get("ln2_post")),
        q=None if "qkv" in names else names.get("q"),
        k=None if "qkv" in names else names.get("k"),
        v=None if "qkv" in names else names.get("v"),
        qkv=names.get("qkv"),
        q_norm=names.get("q_norm"),
        k_norm=names.get("k_norm"),
        mlp_gate=mlp_names.get("gate"),
        parallel=type(blocks).__name__.startswith("Parallel"),
    )


def _name(bridge: Any) -> str | None:
    return None if bridge is None else bridge.name


def adapter_components(config: PretrainedConfig) -> dict[str, Any]:
    """TransformerLens's ``component_mapping`` for ``config``'s architecture (its bridges, each
    with the HuggingFace module ``name`` it wraps and its ``submodules``)."""
    from vlens.names.tl_versions import HAS_BRIDGE

    if not HAS_BRIDGE:
        raise NotImplementedError(
            f"{architecture_of(config)} runs on vLLM's Transformers backend, whose hook names "
            f"vlens reads from TransformerLens 4's adapters; this environment has TransformerLens "
            f"3 (as SAELens pins): install transformer-lens>=4.3 in an environment of its own"
        )
    from transformer_lens.factories.architecture_adapter_factory import (
        ArchitectureAdapterFactory,
    )
    from transformer_lens.model_bridge.sources._bridge_builder import build_bridge_config_from_hf
    from transformer_lens.model_bridge.sources._hf_format import (
        determine_architecture_from_hf_config,
    )

    if not config.architectures:  # a config built in code names none; its class is the model type's
        config = copy.copy(config)
        config.architectures = [architecture_of(config)]
    architecture = determine_architecture_from_hf_config(config)
    bridge_config = build_bridge_config_from_hf(config, architecture, "", None)
    return ArchitectureAdapterFactory.select_architecture_adapter(bridge_config).component_mapping


# ---- reading HuggingFace's modules on a batch of one --------------------------------------------


def out_of(
    path: str, element: int | None = None, shape: str = "pos d_model", shards: Split | None = None
) -> HookSpec:
    reader = readers.OutputOf(element, shards=shards)
    return HookSpec(Site(path, "output"), readers.BatchOfOne(reader), shape)


def into(path: str, argument: Argument, shape: str = "pos d_model") -> HookSpec:
    return HookSpec(Site(path, "input"), readers.BatchOfOne(readers.InputOf(argument)), shape)


def through(of: HookSpec, reader: type, *args: Any, shape: str) -> HookSpec:
    """``reader(source, *args)`` on what ``of`` reads, at its site, under its batch-of-one view."""
    return HookSpec(of.site, readers.BatchOfOne(reader(of.read.source, *args)), shape)


def norm_parts(of: HookSpec, kind: str, eps: float) -> tuple[HookSpec, HookSpec]:
    """``hook_scale`` and ``hook_normalized`` of a norm reading ``of``."""
    if kind == "RMS":
        scale, normalized = readers.RmsScale, readers.RmsNormalized
    else:
        scale, normalized = readers.LayerNormScale, readers.LayerNormNormalized
    return through(of, scale, eps, shape="pos 1"), through(of, normalized, eps, shape=of.shape)


def part(of: HookSpec, start: int, stop: int, d_head: int, heads: str = "head") -> HookSpec:
    """Columns ``start:stop`` of a fused projection, per head."""
    columns = readers.Columns(of.read.source, start, stop)
    per = readers.PerHead(columns, d_head)
    return HookSpec(of.site, readers.BatchOfOne(per), f"pos {heads} d_head")


def per_head_part(of: HookSpec, index: int, d_head: int) -> HookSpec:
    """Part ``index`` of a projection laid out per head as ``[q | k | v]`` (GPT-NeoX)."""
    heads = readers.PerHead(of.read.source, 3 * d_head)
    columns = readers.Columns(heads, index * d_head, (index + 1) * d_head)
    return HookSpec(of.site, readers.BatchOfOne(columns), "pos head d_head")


def per_head(of: HookSpec, d_head: int) -> HookSpec:
    per = readers.PerHead(of.read.source, d_head)
    return HookSpec(of.site, readers.BatchOfOne(per), "pos head d_head")


def heads_copied(of: HookSpec, heads: int, label: str = "head") -> HookSpec:
    copies = readers.RepeatPerHead(of.read.source, heads)
    return HookSpec(of.site, readers.BatchOfOne(copies), f"pos {label} d_model")


# ---- the names --------------------------------------------------------------------------------


def norm_eps(config: PretrainedConfig, details: Details) -> float:
    return getattr(config, details.eps) if isinstance(details.eps, str) else details.eps


def hook_specs_for(config: PretrainedConfig, details: Details) -> dict[str, Spec]:
    """Every name of ``config``'s architecture on vLLM's Transformers backend, with ``{layer}``."""
    layout = layout_of(config)
    eps = norm_eps(config, details)
    heads, kv_heads, d_head = attention_dimensions(config)
    base = VLLM_BASE
    layer = f"{base}.{layout.layers}.{{layer}}"
    attn, mlp = f"{layer}.{layout.attn}", f"{layer}.{layout.mlp}"
    scale = d_head**-0.5

    resid_pre = into(layer, Argument(0, "hidden_states"))
    specs: dict[str, Spec] = {
        "hook_embed": out_of(f"{base}.{layout.embed}"),
        f"{BLOCK}.hook_resid_pre": resid_pre,
        f"{BLOCK}.hook_attn_in": heads_copied(resid_pre, heads),
        f"{BLOCK}.hook_q_input": heads_copied(resid_pre, heads),
        f"{BLOCK}.hook_k_input": heads_copied(resid_pre, kv_heads, "kv_head"),
        f"{BLOCK}.hook_v_input": heads_copied(resid_pre, kv_heads, "kv_head"),
    }
    if layout.ln1 is not None:
        specs.update(norm_specs("ln1", resid_pre, layout.norm, eps))
    specs.update(attention_specs(config, layout, details, attn, scale))
    attn_out = out_of(attn, element=0)
    if layout.ln1_post is not None:
        post = into(f"{layer}.{layout.ln1_post}", Argument(0, "hidden_states"))
        specs.update(norm_specs("ln1_post", post, layout.norm, eps))
        attn_out = out_of(f"{layer}.{layout.ln1_post}")
    specs[f"{BLOCK}.hook_attn_out"] = attn_out
    mlp_in = into(f"{layer}.{layout.ln2}" if layout.ln2 else mlp, Argument(0, "hidden_states"))
    if not layout.parallel:
        specs[f"{BLOCK}.hook_resid_mid"] = mlp_in
    if not layout.parallel or layout.ln2 is not None:  # Phi's MLP reads ln1's output
        specs[f"{BLOCK}.hook_mlp_in"] = mlp_in
    if layout.ln2 is not None:
        specs.update(norm_specs("ln2", mlp_in, layout.norm, eps))
    specs.update(mlp_specs(config, layout, mlp))
    mlp_out = out_of(mlp)
    if layout.ln2_post is not None:
        post = into(f"{layer}.{layout.ln2_post}", Argument(0, "hidden_states"))
        specs.update(norm_specs("ln2_post", post, layout.norm, eps))
        mlp_out = out_of(f"{layer}.{layout.ln2_post}")
    specs[f"{BLOCK}.hook_mlp_out"] = mlp_out
    specs[f"{BLOCK}.hook_resid_post"] = out_of(layer)
    final = into(f"{base}.{layout.ln_final}", Argument(0, "hidden_states"))
    specs["ln_final.hook_scale"], specs["ln_final.hook_normalized"] = norm_parts(
        final, layout.norm, eps
    )
    specs["unembed.hook_out"] = logits(out_of(f"{base}.{layout.ln_final}"))
    if sliding_window(config) is not None:
        del specs[f"{BLOCK}.attn.hook_attn_scores"], specs[f"{BLOCK}.attn.hook_pattern"]
    return specs


def norm_specs(label: str, of: HookSpec, kind: str, eps: float) -> dict[str, Spec]:
    """A block's norm ``label`` (ln1, ln2, ln1_post, ln2_post) reading ``of``."""
    scale, normalized = norm_parts(of, kind, eps)
    return {f"{BLOCK}.{label}.hook_scale": scale, f"{BLOCK}.{label}.hook_normalized": normalized}


def attention_specs(
    config: PretrainedConfig, layout: Layout, details: Details, attn: str, scale: float
) -> dict[str, Spec]:
    heads, kv_heads, d_head = attention_dimensions(config)
    q_end, k_end = heads * d_head, (heads + kv_heads) * d_head
    v_end = k_end + kv_heads * d_head
    if layout.qkv is not None:
        if details.joint_qkv != "per_head":
            raise NotImplementedError(
                f"{config.architectures}: the adapter names a joint qkv projection "
                f"({layout.qkv}); only GPT-NeoX's per-head layout is mapped "
                f"(Details.joint_qkv='per_head')"
            )
        # per head [q | k | v]: each rank's heads, contiguous
        qkv = out_of(f"{attn}.{layout.qkv}", shape="pos", shards=Shards(-1, (v_end,)))
        q, k, v = (per_head_part(qkv, index, d_head) for index in range(3))
    else:
        split = Shards(-1, (q_end, k_end - q_end, v_end - k_end))
        qkv = out_of(f"{attn}.{FUSED_QKV}", shape="pos", shards=split)
        q = part(qkv, 0, q_end, d_head)
        k = part(qkv, q_end, k_end, d_head, "kv_head")
        v = part(qkv, k_end, v_end, d_head, "kv_head")
    specs: dict[str, Spec] = {
        f"{BLOCK}.attn.hook_q": q,
        f"{BLOCK}.attn.hook_k": k,
        f"{BLOCK}.attn.hook_v": v,
    }
    rotate_q, rotate_k = f"{BLOCK}.attn.hook_q", f"{BLOCK}.attn.hook_k"
    if layout.q_norm is not None:  # over the whole projection, before the split into heads
        rotate_q, rotate_k = f"{BLOCK}.attn.hook_q_normed", f"{BLOCK}.attn.hook_k_normed"
        q_split, k_split = Shards(-1, (q_end,)), Shards(-1, (k_end - q_end,))
        specs[rotate_q] = out_of(f"{attn}.{layout.q_norm}", shape="pos heads_d_head", shards=q_split)
        specs[rotate_k] = out_of(f"{attn}.{layout.k_norm}", shape="pos kv_heads_d_head", shards=k_split)
    z = into(f"{attn}.{layout.o}", Argument(0, "input_", Shards(-1, (q_end,))))
    o_weight = f"{layout.base}.{layout.layers}.{{layer}}.{layout.attn}.{layout.o}.weight"
    specs.update({
        f"{BLOCK}.attn.hook_rot_q": rotated(rotate_q, config, d_head),
        f"{BLOCK}.attn.hook_rot_k": rotated(rotate_k, config, d_head, "kv_head"),
        f"{BLOCK}.attn.hook_attn_scores": attention_scores(
            f"{BLOCK}.attn.hook_rot_q", f"{BLOCK}.attn.hook_rot_k", scale, NO_EXPLICIT
        ),
        f"{BLOCK}.attn.hook_pattern": attention_pattern(
            f"{BLOCK}.attn.hook_attn_scores", NO_EXPLICIT
        ),
        f"{BLOCK}.attn.hook_z": per_head(z, d_head),
        f"{BLOCK}.attn.hook_result": head_results(f"{BLOCK}.attn.hook_z", o_weight, NO_EXPLICIT),
    })
    return specs


def mlp_specs(config: PretrainedConfig, layout: Layout, mlp: str) -> dict[str, Spec]:
    d_mlp = config.intermediate_size
    hidden_units = Shards(-1, (d_mlp,))
    post = into(f"{mlp}.{layout.mlp_out}", Argument(0, "input_", hidden_units), shape="pos d_mlp")
    if layout.mlp_gate is None:
        pre = out_of(f"{mlp}.{layout.mlp_in}", shape="pos d_mlp", shards=hidden_units)
        return {f"{BLOCK}.mlp.hook_pre": pre, f"{BLOCK}.mlp.hook_post": post}
    gate_up = out_of(f"{mlp}.{FUSED_GATE_UP}", shape="pos d_mlp", shards=Shards(-1, (d_mlp, d_mlp)))
    gate = through(gate_up, readers.Columns, 0, d_mlp, shape="pos d_mlp")
    up = through(gate_up, readers.Columns, d_mlp, 2 * d_mlp, shape="pos d_mlp")
    return {
        f"{BLOCK}.mlp.hook_pre": gate,
        f"{BLOCK}.mlp.hook_pre_linear": up,
        f"{BLOCK}.mlp.hook_post": post,
    }


def transformers_backend_mapping(
    *architectures: str, details: Details, **fields: Any
) -> ArchitectureMapping:
    """The mapping of ``architectures`` as vLLM's Transformers backend runs them; ``fields``:
    the rest of :class:`~vlens.names.mapping.ArchitectureMapping` (``tiny_configs``, ...)."""
    DETAILS.update(dict.fromkeys(architectures, details))
    return ArchitectureMapping(
        architectures=architectures,
        hook_specs=functools.partial(hook_specs_for, details=details),
        unavailable=windowed_name_error,
        hf_recorder="hf_transformers",
        model_impl="transformers",
        compiled_graph=True,
        not_offered=NOT_DEFAULT,
        tensor_parallel=True,
        **fields,
    )


#: Why a GPU's default engine stays eager for these architectures: their compiled engine, checked
#: on vLLM's CPU compile mode, has not yet run on CUDA.
NOT_DEFAULT = {DEFAULT_GRAPH: "a GPU's default engine stays eager until it has run on CUDA"}
