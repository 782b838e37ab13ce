"""GLM-4 (``Glm4ForCausalLM``) as vLLM builds it, in TransformerLens names.

Llama's decoder layer (``llama.py``: same fused residual, same module names) with two more
RMSNorms, on the attention's and the MLP's outputs before they join the residual stream::

    hidden = self_attn(positions, hidden)
    hidden = post_self_attn_layernorm(hidden)           # hook_attn_out
    hidden, residual = post_attention_layernorm(hidden, residual)
    hidden = post_mlp_layernorm(mlp(hidden))            # hook_mlp_out

``hook_attn_out`` and ``hook_mlp_out`` are those norms' outputs, the terms added to the residual
stream, as in TransformerLens's bridge (its ``ln1_post``/``ln2_post``); ``hook_result`` stays the
per-head output of ``o_proj``, before the norm. The rotary embedding covers half of each head
(``partial_rotary_factor`` 0.5), pairs interleaved; ``hook_rot_q``/``hook_rot_k`` are read after
it, where ``attn`` receives them. The checkpoint stores gate and up as one ``gate_up_proj``,
which the weight views split (``fused_gate_up``).
"""

import dataclasses

from transformers import Glm4Config, PretrainedConfig

from vlens.mappings import llama
from vlens.mappings._tiny import rotary_dims
from vlens.mappings.llama import BLOCK, LAYER, MLP
from vlens.names.mapping import Spec, leaving


def hook_specs(config: PretrainedConfig) -> dict[str, Spec]:
    specs = llama.hook_specs(config)
    specs[f"{BLOCK}.hook_attn_out"] = leaving(f"{LAYER}.post_self_attn_layernorm")
    specs[f"{BLOCK}.hook_mlp_out"] = leaving(f"{LAYER}.post_mlp_layernorm")
    return specs


WEIGHTS = dataclasses.replace(
    llama.WEIGHTS,
    W_gate=f"{MLP}.gate_up_proj.weight",
    W_in=f"{MLP}.gate_up_proj.weight",
    b_in=None,
    fused_gate_up=True,
)


def tiny_config() -> PretrainedConfig:
    """GLM-4: q/k/v biases, rotary on half of each head, untied unembedding."""
    return Glm4Config(
        **rotary_dims(), head_dim=32, rms_norm_eps=1e-5, pad_token_id=None,
        tie_word_embeddings=False,
    )


MAPPING = llama.MAPPING.member(
    "Glm4ForCausalLM",
    hook_specs=hook_specs,
    weights=WEIGHTS,
    tiny_configs={"glm4": tiny_config},
    hf_recorder="hf_decoder",
)
