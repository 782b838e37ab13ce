"""OLMo-2 (``Olmo2ForCausalLM``) on vLLM's Transformers backend
(:mod:`vlens.mappings._transformers`): HuggingFace's modules, named by TransformerLens's adapter.

Norms after each sublayer only (``post_attention_layernorm`` on the attention's output,
``post_feedforward_layernorm`` on the MLP's), each added to the residual: no ``ln1``/``ln2``;
``ln1_post``/``ln2_post`` are those norms, ``hook_attn_out``/``hook_mlp_out`` their outputs, as in
TransformerLens. ``q_norm``/``k_norm`` are RMSNorms over the whole q and k projections, before
the split into heads and rotary (``attn.hook_q_normed``/``hook_k_normed``,
``[pos, heads·d_head]``).
"""

from transformers import Olmo2Config, PretrainedConfig

from vlens.mappings._tiny import rotary_dims
from vlens.mappings._transformers import Details, transformers_backend_mapping
from vlens.names.weights import WeightNames

LAYER = "model.layers.{layer}"


def tiny_config() -> PretrainedConfig:
    return Olmo2Config(**rotary_dims(), rms_norm_eps=1e-6)


WEIGHTS = WeightNames(
    normalization="RMS",
    eps="rms_norm_eps",
    W_E="model.embed_tokens.weight",
    W_Q=f"{LAYER}.self_attn.q_proj.weight",
    W_K=f"{LAYER}.self_attn.k_proj.weight",
    W_V=f"{LAYER}.self_attn.v_proj.weight",
    W_O=f"{LAYER}.self_attn.o_proj.weight",
    W_in=f"{LAYER}.mlp.up_proj.weight",
    W_gate=f"{LAYER}.mlp.gate_proj.weight",
    W_out=f"{LAYER}.mlp.down_proj.weight",
    ln_final_w="model.norm.weight",
    W_U=("lm_head.weight", "model.embed_tokens.weight"),
)

MAPPING = transformers_backend_mapping(
    "Olmo2ForCausalLM",
    details=Details(eps="rms_norm_eps"),
    weights=WEIGHTS,
    tiny_configs={"olmo2": tiny_config},
)
