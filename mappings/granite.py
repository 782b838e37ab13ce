"""Granite (``GraniteForCausalLM``) as vLLM builds it, in TransformerLens names.

Llama's attention and gated MLP modules (``llama.py``) with four multipliers from the config and
a plain residual (no fused add). The model and one layer (``model.layers.{layer}``, called
``layer(positions, hidden)``, returning the stream)::

    hidden = embed_tokens(ids); hidden *= embedding_multiplier   # in place: hook_embed
    residual = hidden                                             # resid_pre
    attn = self_attn(positions, input_layernorm(hidden))          # scores · attention_multiplier
    hidden = residual + attn * residual_multiplier                # resid_mid
    residual = hidden
    hidden = residual + mlp(post_attention_layernorm(hidden)) * residual_multiplier
    hidden = norm(hidden)                                         # logits: lm_head / logits_scaling

Names carry TransformerLens's meaning (its bridge's Granite adapter): ``hook_embed`` is the scaled
embedding, read where layer 0 receives it (``embed_tokens``' result is scaled in place after it
returns); ``hook_attn_out``, ``hook_mlp_out`` and ``hook_result`` are the terms the residual
stream receives, scaled by ``residual_multiplier``; attention scores use ``attention_multiplier``
as their scale; ``unembed.hook_out`` is the logits divided by ``logits_scaling``, as vLLM's
logits processor divides them. Per-head results are not formed in the worker for hooks (the
explicit attention's output projection is ``o_proj``'s, before the multiplier); scores and
patterns are.
"""

import dataclasses
from dataclasses import dataclass

from torch import Tensor
from transformers import GraniteConfig, PretrainedConfig

from vlens.mappings import llama
from vlens.mappings._tiny import rotary_dims
from vlens.mappings.llama import ATTN, BLOCK, LAYER, MLP, ResidualStream
from vlens.names import derived
from vlens.names.mapping import (
    Argument,
    DerivedSpec,
    HookSpec,
    NoExplicitAttention,
    Spec,
    attention_pattern,
    attention_scores,
    entering,
    leaving,
)
from vlens.runtime.vocabulary.locations import SiteCall
from vlens.runtime.vocabulary.readers import Reader


@dataclass(frozen=True)
class Scaled:
    """The source times ``factor``; an edit is written back divided by it."""

    source: Reader
    factor: float

    def __call__(self, call: SiteCall) -> Tensor:
        return self.source(call) * self.factor

    def write(self, call: SiteCall, new: Tensor) -> None:
        self.source.write(call, new / self.factor)


@dataclass(frozen=True)
class ScaledHeadResults:
    """:class:`~vlens.names.derived.HeadResults` times ``factor``."""

    results: derived.HeadResults
    factor: float

    def for_layer(self, layer: int) -> "ScaledHeadResults":
        return ScaledHeadResults(self.results.for_layer(layer), self.factor)

    def __call__(self, sources: list[Tensor], batch: derived.Batch) -> Tensor:
        return self.results(sources, batch) * self.factor


def scaled(of: HookSpec, factor: float) -> HookSpec:
    return HookSpec(of.site, Scaled(of.read, factor), of.shape)


def residual_stream(eps: float) -> ResidualStream:
    """The stream as the block's argument and result and the RMSNorms' inputs (no fused add)."""
    return ResidualStream(
        pre=entering(LAYER, Argument(1, "hidden_states")),
        mid=entering(f"{LAYER}.post_attention_layernorm", Argument(0, "x")),
        post=leaving(LAYER),
        final=entering("model.norm", Argument(0, "x")),
        final_normed=leaving("model.norm"),
        eps=eps,
    )


def hook_specs(config: PretrainedConfig) -> dict[str, Spec]:
    specs = llama.decoder_specs(config, residual_stream(config.rms_norm_eps))
    multiplier = config.residual_multiplier
    scale = config.attention_multiplier
    explicit = llama.explicit_attention(config, scale)
    results = derived.HeadResults("model.layers.{layer}.self_attn.o_proj.weight")
    unscaled_results = NoExplicitAttention(
        "Granite's per-head results include residual_multiplier, which the explicitly computed "
        "attention's output projection (o_proj) does not apply; hook attn.hook_z instead"
    )
    specs["hook_embed"] = entering("model.layers.0", Argument(1, "hidden_states"))
    specs[f"{BLOCK}.attn.hook_attn_scores"] = attention_scores(
        f"{BLOCK}.attn.hook_rot_q", f"{BLOCK}.attn.hook_rot_k", scale, explicit
    )
    specs[f"{BLOCK}.attn.hook_pattern"] = attention_pattern(
        f"{BLOCK}.attn.hook_attn_scores", explicit
    )
    specs[f"{BLOCK}.attn.hook_result"] = DerivedSpec(
        (f"{BLOCK}.attn.hook_z",),
        ScaledHeadResults(results, multiplier),
        "pos head d_model",
        hookable=unscaled_results,
    )
    specs[f"{BLOCK}.hook_attn_out"] = scaled(leaving(ATTN), multiplier)
    specs[f"{BLOCK}.hook_mlp_out"] = scaled(leaving(MLP), multiplier)
    return specs


def tiny_config() -> PretrainedConfig:
    """Granite: every multiplier away from 1 (and the attention's from 1/sqrt(d_head)), so that
    a name missing one is visibly wrong; tied embeddings as in Granite 3."""
    return GraniteConfig(
        **rotary_dims(),
        rms_norm_eps=1e-5,
        embedding_multiplier=4.0,
        residual_multiplier=0.5,
        attention_multiplier=0.25,
        logits_scaling=2.0,
        pad_token_id=None,
        tie_word_embeddings=True,
    )


WEIGHTS = dataclasses.replace(llama.WEIGHTS, logit_divisor="logits_scaling")

MAPPING = llama.MAPPING.member(
    "GraniteForCausalLM",
    hook_specs=hook_specs,
    weights=WEIGHTS,
    tiny_configs={"granite": tiny_config},
    hf_recorder="hf_decoder",
)
