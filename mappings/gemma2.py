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
from vlens.mappings.llama import ATTN, BLOCK, LAYER, MLP
from vlens.mappings.llama import WEIGHTS as LLAMA_WEIGHTS
from vlens.names import derived
from vlens.names.mapping import (
    ArchitectureMapping,
    Argument,
    DerivedSpec,
    HookSpec,
    NoExplicitAttention,
    Shards,
    Site,
    Spec,
    attention_dimensions,
    attention_pattern,
    columns,
    entering,
    head_results,
    leaving,
    per_head,
    repeated_per_head,
    rms_normalized,
    rms_scale,
)
from vlens.runtime.locations import SiteCall
from vlens.runtime.readers import LogitsOf, OutputOf

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
    eps = config.rms_norm_eps
    heads, kv_heads, d_head = attention_dimensions(config)
    q_end, k_end = heads * d_head, (heads + kv_heads) * d_head
    v_end = k_end + kv_heads * d_head
    d_mlp = config.intermediate_size
    scale = config.query_pre_attn_scalar**-0.5
    soft_cap = getattr(config, "attn_logit_softcapping", None)

    resid_pre = entering(LAYER, Argument(1, "hidden_states"), plus=Argument(2, "residual"))
    attn_out = leaving(f"{LAYER}.post_attention_layernorm")
    resid_mid = entering(
        f"{LAYER}.pre_feedforward_layernorm", Argument(0, "x"), plus=Argument(1, "residual")
    )
    final = leaving("model.norm", element=0)
    resid_final = entering("model.norm", Argument(0, "x"), plus=Argument(1, "residual"))
    attn_raw = entering(f"{LAYER}.post_attention_layernorm", Argument(0, "x"))
    mlp_raw = entering(f"{LAYER}.post_feedforward_layernorm", Argument(0, "x"))
    q_heads, kv_heads_split = Shards(-1, (q_end,)), Shards(-1, (k_end - q_end,))
    qkv = leaving(f"{ATTN}.qkv_proj", element=0)
    gate_up = leaving(f"{MLP}.gate_up_proj", element=0)
    scores = DerivedSpec(
        (f"{BLOCK}.attn.hook_rot_q", f"{BLOCK}.attn.hook_rot_k"),
        LayerAttentionScores(scale, soft_cap, layer_windows(config)),
        "head query_pos key_pos",
        hookable=NOT_EXPLICIT,
    )
    return {
        "hook_embed": scaled_embedding(config),
        f"{BLOCK}.hook_resid_pre": resid_pre,
        f"{BLOCK}.hook_attn_in": repeated_per_head(resid_pre, heads),
        f"{BLOCK}.hook_q_input": repeated_per_head(resid_pre, heads),
        f"{BLOCK}.hook_k_input": repeated_per_head(resid_pre, kv_heads, "kv_head"),
        f"{BLOCK}.hook_v_input": repeated_per_head(resid_pre, kv_heads, "kv_head"),
        f"{BLOCK}.ln1.hook_scale": rms_scale(resid_pre, eps),
        f"{BLOCK}.ln1.hook_normalized": rms_normalized(resid_pre, eps),
        f"{BLOCK}.attn.hook_q": per_head(columns(qkv, 0, q_end, "pos"), d_head),
        f"{BLOCK}.attn.hook_k": per_head(columns(qkv, q_end, k_end, "pos"), d_head, "kv_head"),
        f"{BLOCK}.attn.hook_v": per_head(columns(qkv, k_end, v_end, "pos"), d_head, "kv_head"),
        f"{BLOCK}.attn.hook_rot_q": per_head(
            entering(f"{ATTN}.attn", Argument(0, "query", q_heads)), d_head
        ),
        f"{BLOCK}.attn.hook_rot_k": per_head(
            entering(f"{ATTN}.attn", Argument(1, "key", kv_heads_split)), d_head, "kv_head"
        ),
        f"{BLOCK}.attn.hook_attn_scores": scores,
        f"{BLOCK}.attn.hook_pattern": attention_pattern(
            f"{BLOCK}.attn.hook_attn_scores", NOT_EXPLICIT
        ),
        f"{BLOCK}.attn.hook_z": per_head(entering(f"{ATTN}.o_proj", Argument(0, "input_")), d_head),
        f"{BLOCK}.attn.hook_result": head_results(
            f"{BLOCK}.attn.hook_z", f"{ATTN}.o_proj.weight", NOT_EXPLICIT
        ),
        f"{BLOCK}.ln1_post.hook_scale": rms_scale(attn_raw, eps),
        f"{BLOCK}.ln1_post.hook_normalized": rms_normalized(attn_raw, eps),
        f"{BLOCK}.hook_attn_out": attn_out,
        f"{BLOCK}.hook_resid_mid": resid_mid,
        f"{BLOCK}.hook_mlp_in": resid_mid,
        f"{BLOCK}.ln2.hook_scale": rms_scale(resid_mid, eps),
        f"{BLOCK}.ln2.hook_normalized": rms_normalized(resid_mid, eps),
        f"{BLOCK}.mlp.hook_pre": columns(gate_up, 0, d_mlp, "pos d_mlp"),
        f"{BLOCK}.mlp.hook_pre_linear": columns(gate_up, d_mlp, 2 * d_mlp, "pos d_mlp"),
        f"{BLOCK}.mlp.hook_post": entering(
            f"{MLP}.down_proj", Argument(0, "input_"), shape="pos d_mlp"
        ),
        f"{BLOCK}.ln2_post.hook_scale": rms_scale(mlp_raw, eps),
        f"{BLOCK}.ln2_post.hook_normalized": rms_normalized(mlp_raw, eps),
        f"{BLOCK}.hook_mlp_out": leaving(f"{LAYER}.post_feedforward_layernorm"),
        f"{BLOCK}.hook_resid_post": leaving(LAYER, element=0, plus=1),
        "ln_final.hook_scale": rms_scale(resid_final, eps),
        "ln_final.hook_normalized": rms_normalized(resid_final, eps),
        "unembed.hook_out": HookSpec(
            final.site, LogitsOf(final.read), "pos d_vocab"
        ),
    }


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
)
