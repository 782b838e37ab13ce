"""Nemotron (``NemotronForCausalLM``: Nemotron-3/4, Minitron) as vLLM builds it, in TransformerLens
names.

Llama's attention modules and fused residual (``llama.py``: ``qkv_proj``, ``rotary_emb``, ``attn``,
``o_proj``; each add fused into the norm that follows it), with three differences: every norm is
``NemotronLayerNorm1P``, a LayerNorm with a bias that scales by ``1 + weight``; the MLP has no gate;
and only the first ``partial_rotary_factor·d_head`` features of each q and k head are rotated. One
layer (``model.layers.{layer}``, called ``layer(positions, hidden, residual)``)::

    hidden, residual = input_layernorm(hidden, residual)    # residual ← hidden + residual
                                                            # (layer 0: residual ← hidden)
    self_attn(positions, hidden):
        qkv, _ = qkv_proj(hidden)                           # [q | k | v], GQA
        q, k = rotary_emb(positions, q, k)                  # rotate-half on the first rotary_dim
        z = attn(q, k, v)                                   # features of each head
        hidden, _ = o_proj(z)
    hidden, residual = post_attention_layernorm(hidden, residual)
    mlp(hidden):
        x, _ = up_proj(hidden)                              # hook_pre
        x = act_fn(x)                                       # relu(x)², hook_post
        hidden, _ = down_proj(x)
    return hidden, residual                                 # the stream leaving is their sum

``ln*.hook_scale``/``hook_normalized`` are the LayerNorm's (centred), before its ``1 + weight`` and
bias, as TransformerLens's bridge gives them; the weight views add the 1 (``norm_offset``).
``hook_rot_q``/``hook_rot_k`` are whole heads, read where ``attn`` receives them (the features past
the rotary part as they left the projection); scores are rebuilt from them with ``1/sqrt(d_head)``.
There is no ``mlp.hook_pre_linear``: the MLP's one input projection gives ``hook_pre``.
"""

import dataclasses

from transformers import NemotronConfig, PretrainedConfig

from vlens.mappings import llama
from vlens.mappings._tiny import rotary_dims
from vlens.mappings.llama import BLOCK, LAYER, MLP, fused_residual
from vlens.names.mapping import (
    Shards,
    Spec,
    layer_norm_normalized,
    layer_norm_scale,
    leaving,
)


def hook_specs(config: PretrainedConfig) -> dict[str, Spec]:
    stream = dataclasses.replace(
        fused_residual(config.norm_eps), scale=layer_norm_scale, normalized=layer_norm_normalized
    )
    specs = llama.decoder_specs(config, stream)
    d_mlp = config.intermediate_size
    specs[f"{BLOCK}.mlp.hook_pre"] = leaving(
        f"{MLP}.up_proj", element=0, shape="pos d_mlp", shards=Shards(-1, (d_mlp,))
    )
    del specs[f"{BLOCK}.mlp.hook_pre_linear"]
    return specs


def tiny_config() -> PretrainedConfig:
    """Nemotron: GQA, heads of 32 of which half is rotated (its usual factor, 0.5), squared-ReLU
    MLP, untied unembedding."""
    dims = rotary_dims()
    rope = {**dims.pop("rope_parameters"), "partial_rotary_factor": 0.5}
    return NemotronConfig(
        **dims,
        head_dim=32,
        rope_parameters=rope,
        partial_rotary_factor=0.5,
        norm_eps=1e-5,
        hidden_act="relu2",
        tie_word_embeddings=False,
    )


WEIGHTS = dataclasses.replace(
    llama.WEIGHTS,
    normalization="LN",
    eps="norm_eps",
    norm_offset=1.0,
    W_gate=None,
    ln1_b=f"{LAYER}.input_layernorm.bias",
    ln2_b=f"{LAYER}.post_attention_layernorm.bias",
    ln_final_b="model.norm.bias",
)

MAPPING = llama.MAPPING.member(
    "NemotronForCausalLM",
    hook_specs=hook_specs,
    weights=WEIGHTS,
    # Traced, its MLP's values differ from eager by up to 6.5e-5 element by element (relu² of
    # values near zero; 2.2e-6 relative per token): tests/engine/test_compiled.py holds it token
    # by token there.
    unavailable=None,
    tiny_configs={"nemotron": tiny_config},
    hf_recorder="hf_decoder",
)
