"""Gemma 3, text only (``Gemma3ForCausalLM``), as vLLM builds it: Gemma 2's layer (``gemma2.py``)
with a per-head RMSNorm (``1 + weight``) on q and k before the rotary embedding::

    q = q_norm(q.view(pos, H, d_head))      # attn.hook_q_normed
    k = k_norm(k.view(pos, Hkv, d_head))    # attn.hook_k_normed
    q, k = rotary_emb(positions, q, k)      # attn.hook_rot_q, attn.hook_rot_k

Sliding (local) layers rotate with ``rope_parameters["sliding_attention"]``, global ones with
``rope_parameters["full_attention"]``: each layer's own ``rotary_emb`` does it, so the rotated q and
k read here need nothing more. Gemma 3 has no attention-logit soft cap
(``attn_logit_softcapping`` None); its sliding windows are Gemma 2's.
"""

from transformers import Gemma3TextConfig, PretrainedConfig

from vlens.mappings import gemma2
from vlens.mappings.llama import BLOCK, per_head_norms
from vlens.names.mapping import Spec, inserted_before, leaving, logits


def hook_specs(config: PretrainedConfig) -> dict[str, Spec]:
    """Gemma 2's names with Gemma 3's per-head q/k norms (``q_norm``, ``k_norm``, before the
    rotary embedding), heads-first as TransformerLens's bridge gives them; the logits through
Gemma 3's ``lm_head`` (tied to the embedding or not, as the config says)."""
    specs = gemma2.hook_specs(config)
    return {
        **inserted_before(specs, f"{BLOCK}.attn.hook_rot_q", per_head_norms(config)),
        "unembed.hook_out": logits(leaving("model.norm", element=0)),
    }


def tiny_config() -> PretrainedConfig:
    """Gemma 3 (text): two sliding layers with a local rotary base, then a global one."""
    settings = gemma2.gemma_dims()
    del settings["rope_parameters"]
    return Gemma3TextConfig(
        **settings,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    )


MAPPING = gemma2.MAPPING.member(
    "Gemma3ForCausalLM", hook_specs=hook_specs, tiny_configs={"gemma3": tiny_config}
)
