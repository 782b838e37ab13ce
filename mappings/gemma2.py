"""Gemma 2 (``Gemma2ForCausalLM``) as vLLM builds it, in TransformerLens names.

Gemma 2's modules are named as Llama's (``llama.py``), but its decoder layer normalises each
sublayer's output before adding it to the residual stream, so the fused residual flows otherwise.
One layer (``model.layers.{layer}``, called as ``layer(positions, hidden, residual)``)::

    hidden, residual = input_layernorm(hidden, residual)    # residual ← hidden + residual
                                                            # (layer 0: residual ← hidden)
    hidden = self_attn(positions, hidden)                   # qkv_proj, rotary_emb, attn, o_proj
    hidden = post_attention_layernorm(hidden)               # no residual: normalises attn's output
    hidden, residual = pre_feedforward_layernorm(hidden, residual)   # residual ← resid_mid
    hidden = mlp(hidden)                                    # gelu_tanh(gate) · up, down_proj
    hidden = post_feedforward_layernorm(hidden)
    return hidden, residual                                 # the stream leaving is their sum

Every norm is ``GemmaRMSNorm``, which scales by ``1 + weight``; TransformerLens's
``hook_normalized`` is before the weight, so the offset changes no name here. The embedding is
multiplied by ``√d_model`` in ``Gemma2Model.embed_input_ids``, outside ``embed_tokens``:
``hook_embed`` is that product, as TransformerLens's bridge gives it (HuggingFace scales inside
its embedding module). ``ln1_post`` and ``ln2_post`` are the post-sublayer norms
(TransformerLens's names); ``hook_attn_out`` and ``hook_mlp_out`` are what each sublayer adds to
the stream, after its post-norm.

Attention: ``q·kᵀ`` is scaled by ``query_pre_attn_scalar^-½`` and soft-capped
(``attn_logit_softcapping``); layers whose ``layer_types`` entry is ``sliding_attention`` attend
over the last ``sliding_window`` keys only. Scores and patterns are rebuilt with both; hooks on
them, and on per-head results, cannot run explicitly (:class:`~vlens.names.mapping.ExplicitAttention`
computes plain causal attention). The logits processor soft-caps the logits
(``final_logit_softcapping``); ``unembed.hook_out`` is the capped logits, as HuggingFace's. vLLM's
Gemma 2 has no ``lm_head``: its logits always go through the embedding (tied), so a checkpoint
with ``tie_word_embeddings=False`` fails to load.

Gemma 3 (``Gemma3ForCausalLM``, text only) is this mapping with per-head q/k norms
(``gemma3.py``); its local and global layers use different rotary bases, which the
rotated q and k read here already carry.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor
from transformers import Gemma2Config, PretrainedConfig

from vlens.mappings._tiny import rotary_dims
from vlens.mappings.llama import ATTN, BLOCK, LAYER, decoder_specs, fused_residual
from vlens.mappings.llama import WEIGHTS as LLAMA_WEIGHTS
from vlens.names import derived
from vlens.names.mapping import (
    ArchitectureMapping,
    Argument,
    DerivedSpec,
    HookSpec,
    NoExplicitAttention,
    Site,
    Spec,
    attention_pattern,
    entering,
    head_results,
    leaving,
    names_after,
    rms_normalized,
    rms_scale,
)
from vlens.runtime.vocabulary.locations import SiteCall
from vlens.runtime.vocabulary.readers import OutputOf

NOT_EXPLICIT = NoExplicitAttention(
    "Gemma's attention soft-caps its logits and/or attends over a sliding window on some layers, "
    "which vlens's explicit attention does not compute; hook attn.hook_rot_q, attn.hook_rot_k, "
    "attn.hook_v or attn.hook_z instead"
)


@dataclass(frozen=True)
class ScaledOutput:
    """The module's output times ``factor`` (Gemma's embedding times ``√d_model``, which vLLM
    applies after ``embed_tokens``); an edit is written back divided by it."""

    factor: float

    def __call__(self, call: SiteCall) -> Tensor:
        value = OutputOf()(call)
        return value * torch.tensor(self.factor, dtype=value.dtype)

    def write(self, call: SiteCall, new: Tensor) -> None:
        value = OutputOf()(call)
        OutputOf().write(call, new / torch.tensor(self.factor, dtype=value.dtype))


@dataclass(frozen=True)
class LayerAttentionScores:
    """:class:`~vlens.names.derived.AttentionScores` whose sliding window depends on the layer:
    ``windows[layer]`` (None: fully causal)."""

    scale: float
    soft_cap: float | None
    windows: tuple[int | None, ...]

    def for_layer(self, layer: int) -> derived.AttentionScores:
        return derived.AttentionScores(self.scale, self.soft_cap, self.windows[layer])


def scaled_embedding(config: PretrainedConfig) -> HookSpec:
    """``hook_embed``: ``embed_tokens``'s output times ``√d_model``."""
    return HookSpec(
        Site("model.embed_tokens", "output"), ScaledOutput(config.hidden_size**0.5), "pos d_model"
    )


def layer_windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    """Each layer's sliding window: ``sliding_window`` on ``sliding_attention`` layers."""
    return tuple(
        config.sliding_window if kind == "sliding_attention" else None
        for kind in config.layer_types
    )


def hook_specs(config: PretrainedConfig) -> dict[str, Spec]:
    """Llama's names over Gemma 2's residual stream, with its scaled embedding, its attention
    scores (scaled, soft-capped, windowed per layer: rebuilt, never computed explicitly) and its
    post-sublayer norms, whose outputs are what attention and the MLP add to the stream."""
    eps = config.rms_norm_eps
    stream = replace(
        fused_residual(eps),
        mid=entering(
            f"{LAYER}.pre_feedforward_layernorm", Argument(0, "x"), plus=Argument(1, "residual")
        ),
    )
    attn_raw = entering(f"{LAYER}.post_attention_layernorm", Argument(0, "x"))
    mlp_raw = entering(f"{LAYER}.post_feedforward_layernorm", Argument(0, "x"))
    scores = DerivedSpec(
        (f"{BLOCK}.attn.hook_rot_q", f"{BLOCK}.attn.hook_rot_k"),
        LayerAttentionScores(
            config.query_pre_attn_scalar**-0.5,
            getattr(config, "attn_logit_softcapping", None),
            layer_windows(config),
        ),
        "head query_pos key_pos",
        hookable=NOT_EXPLICIT,
    )
    specs = decoder_specs(config, stream)
    specs.update({
        "hook_embed": scaled_embedding(config),
        f"{BLOCK}.attn.hook_result": head_results(
            f"{BLOCK}.attn.hook_z", f"{ATTN}.o_proj.weight", NOT_EXPLICIT
        ),
        f"{BLOCK}.hook_attn_out": leaving(f"{LAYER}.post_attention_layernorm"),
        f"{BLOCK}.hook_mlp_out": leaving(f"{LAYER}.post_feedforward_layernorm"),
    })
    specs = names_after(specs, f"{BLOCK}.attn.hook_rot_k", {
        f"{BLOCK}.attn.hook_attn_scores": scores,
        f"{BLOCK}.attn.hook_pattern": attention_pattern(
            f"{BLOCK}.attn.hook_attn_scores", NOT_EXPLICIT
        ),
    })
    specs = names_after(specs, f"{BLOCK}.attn.hook_result", {
        f"{BLOCK}.ln1_post.hook_scale": rms_scale(attn_raw, eps),
        f"{BLOCK}.ln1_post.hook_normalized": rms_normalized(attn_raw, eps),
    })
    return names_after(specs, f"{BLOCK}.mlp.hook_post", {
        f"{BLOCK}.ln2_post.hook_scale": rms_scale(mlp_raw, eps),
        f"{BLOCK}.ln2_post.hook_normalized": rms_normalized(mlp_raw, eps),
    })


def gemma_dims() -> dict:
    """What the tiny Gemma configs share: Llama's tiny sizes with head_dim 32, a sliding window of
    8 keys (shorter than the parity prompts) and a query scalar other than head_dim."""
    return {
        **rotary_dims(),
        "head_dim": 32,
        "sliding_window": 8,
        "query_pre_attn_scalar": 64,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
    }


def tiny_config() -> PretrainedConfig:
    """Gemma 2: sliding and global layers alternating; soft caps small enough to bend the tiny
    model's logits (vLLM's Gemma 2 always ties the unembedding to the embedding)."""
    return Gemma2Config(
        **gemma_dims(),
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
    )


#: Llama's checkpoint names, with Gemma's ``(1 + w)`` norms, its capped logits, and the norm before
#: the MLP as ``ln2`` (the post-norms are not among the weight views).
WEIGHTS = replace(
    LLAMA_WEIGHTS,
    norm_offset=1.0,
    logit_soft_cap="final_logit_softcapping",
    ln2_w=f"{LAYER}.pre_feedforward_layernorm.weight",
)

MAPPING = ArchitectureMapping(
    architectures=("Gemma2ForCausalLM",),
    hook_specs=hook_specs,
    weights=WEIGHTS,
    tiny_configs={"gemma2": tiny_config},
    hf_recorder="hf_gemma",
    compiled_graph=True,
    tensor_parallel=True,
)
