"""Llama (``LlamaForCausalLM``) as vLLM builds it, in TransformerLens names.

vLLM fuses each residual add into the RMSNorm that follows it. One decoder layer, top to bottom
(``model.layers.{layer}``, called as ``layer(positions, hidden, residual)``)::

    hidden, residual = input_layernorm(hidden, residual)    # residual ← hidden + residual
                                                            # (layer 0: residual ← hidden)
    hidden = self_attn(positions=..., hidden_states=hidden) # qkv_proj → rotary_emb → attn → o_proj
    hidden, residual = post_attention_layernorm(hidden, residual)
    hidden = mlp(hidden)                                    # gate_up_proj → act_fn → down_proj
    return hidden, residual                                 # the stream leaving is their sum

After the last layer, ``model.norm(hidden, residual)`` adds them once more and normalises; the
logits processor applies ``lm_head`` to its first output.
"""

from transformers import PretrainedConfig

from vlens.mapping import (
    ArchitectureMapping,
    Argument,
    HookSpec,
    entering,
    leaving,
    logits,
    rms_normalized,
    rms_scale,
)

LAYER = "model.layers.{layer}"


def hook_specs(config: PretrainedConfig) -> dict[str, HookSpec]:
    eps = config.rms_norm_eps
    resid_final = entering("model.norm", Argument(0, "x"), plus=Argument(1, "residual"))
    return {
        "hook_embed": leaving("model.embed_tokens"),
        "blocks.{layer}.hook_resid_pre": entering(
            LAYER, Argument(1, "hidden_states"), plus=Argument(2, "residual")
        ),
        "blocks.{layer}.hook_attn_out": leaving(f"{LAYER}.self_attn"),
        "blocks.{layer}.hook_resid_mid": entering(
            f"{LAYER}.post_attention_layernorm", Argument(0, "x"), plus=Argument(1, "residual")
        ),
        "blocks.{layer}.hook_mlp_out": leaving(f"{LAYER}.mlp"),
        "blocks.{layer}.hook_resid_post": leaving(LAYER, element=0, plus=1),
        "ln_final.hook_scale": rms_scale(resid_final, eps),
        "ln_final.hook_normalized": rms_normalized(resid_final, eps),
        "unembed.hook_out": logits(leaving("model.norm", element=0)),
    }


MAPPING = ArchitectureMapping(architectures=("LlamaForCausalLM",), hook_specs=hook_specs)
