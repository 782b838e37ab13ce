"""StableLM (``StableLmForCausalLM``) as vLLM builds it, in TransformerLens names.

Llama's attention and gated MLP modules (``llama.py``: ``qkv_proj``, ``rotary_emb``, ``attn``,
``o_proj``; ``gate_up_proj``, ``down_proj``), but LayerNorms with weight and bias and a plain
residual, no fused add. One layer (``model.layers.{layer}``, called ``layer(positions, hidden)``)::

    residual = hidden                                   # resid_pre
    hidden = input_layernorm(hidden)                    # nn.LayerNorm
    hidden = residual + self_attn(positions, hidden)    # resid_mid
    residual = hidden
    hidden = residual + mlp(post_attention_layernorm(hidden))
    return hidden, residual                             # resid_post is the first

After the last layer, ``model.norm`` (a LayerNorm) gives what ``lm_head`` reads. The rotary
embedding covers the first ``partial_rotary_factor`` of each head (a quarter in StableLM 2);
``hook_rot_q``/``hook_rot_k`` are whole heads, read where ``attn`` receives them.

vLLM's StableLM reads neither ``use_parallel_residual`` nor ``qk_layernorm``: it always builds
the sequential block above, without q/k norms, so checkpoints that set either (StableLM 2 12B)
are computed differently from HuggingFace by vLLM itself; this mapping refuses them.
"""

import dataclasses

from transformers import PretrainedConfig, StableLmConfig

from vlens.mappings import llama
from vlens.mappings._tiny import rotary_dims
from vlens.mappings.llama import LAYER, ResidualStream
from vlens.names.mapping import (
    Argument,
    Spec,
    entering,
    layer_norm_normalized,
    layer_norm_scale,
    leaving,
)


def residual_stream(eps: float) -> ResidualStream:
    """The stream as the block's argument and result and the LayerNorms' inputs."""
    return ResidualStream(
        pre=entering(LAYER, Argument(1, "hidden_states")),
        mid=entering(f"{LAYER}.post_attention_layernorm", Argument(0, "input")),
        post=leaving(LAYER, element=0),
        final=entering("model.norm", Argument(0, "input")),
        final_normed=leaving("model.norm"),
        eps=eps,
        scale=layer_norm_scale,
        normalized=layer_norm_normalized,
    )


def hook_specs(config: PretrainedConfig) -> dict[str, Spec]:
    for unsupported in ("use_parallel_residual", "qk_layernorm"):
        if getattr(config, unsupported, False):
            raise NotImplementedError(
                f"this StableLM checkpoint sets {unsupported}=True, which vLLM's StableLM "
                f"ignores (it computes a sequential block without q/k norms), so its values "
                f"would not be the model's; only checkpoints without it are served"
            )
    return llama.decoder_specs(config, residual_stream(config.layer_norm_eps))


WEIGHTS = dataclasses.replace(
    llama.WEIGHTS,
    normalization="LN",
    eps="layer_norm_eps",
    ln1_b=f"{LAYER}.input_layernorm.bias",
    ln2_b=f"{LAYER}.post_attention_layernorm.bias",
    ln_final_b="model.norm.bias",
)


def tiny_config() -> PretrainedConfig:
    """StableLM 2: rotary on a quarter of each head, q/k/v biases, untied unembedding."""
    return StableLmConfig(
        **rotary_dims(), layer_norm_eps=1e-5, use_qkv_bias=True, tie_word_embeddings=False
    )


MAPPING = llama.MAPPING.member(
    "StableLmForCausalLM",
    hook_specs=hook_specs,
    weights=WEIGHTS,
    tiny_configs={"stablelm": tiny_config},
    hf_recorder="hf_decoder",
)
