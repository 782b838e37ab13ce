"""Phi-3 (``Phi3ForCausalLM``) as vLLM builds it: Llama's modules and forward (vLLM's
``Phi3ForCausalLM`` is its ``LlamaForCausalLM``), so Llama's mapping (``llama.py``).

The checkpoint differs from Llama's in form only: it stores q, k and v as one ``qkv_proj`` and
gate and up as one ``gate_up_proj``, which vLLM loads as they are into the same fused modules it
builds for Llama. The HuggingFace reference splits them (``parity/hf_decoder.py``), and so do the
weight views (``W_QKV``, ``fused_gate_up``).
"""

import dataclasses

from transformers import Phi3Config, PretrainedConfig

from vlens.mappings import llama
from vlens.mappings._tiny import rotary_dims
from vlens.mappings.llama import ATTN, MLP

WEIGHTS = dataclasses.replace(
    llama.WEIGHTS,
    W_Q=None,
    W_K=None,
    W_V=None,
    b_Q=None,
    b_K=None,
    b_V=None,
    W_QKV=f"{ATTN}.qkv_proj.weight",
    W_gate=f"{MLP}.gate_up_proj.weight",
    W_in=f"{MLP}.gate_up_proj.weight",
    b_in=None,
    fused_gate_up=True,
)


def tiny_config() -> PretrainedConfig:
    """Phi-3: untied unembedding, full rotary, no sliding window (Phi-3-mini's 2047 is left out
    so that scores and patterns are served)."""
    return Phi3Config(
        **rotary_dims(), rms_norm_eps=1e-5, sliding_window=None, pad_token_id=None,
        tie_word_embeddings=False,
    )


MAPPING = llama.MAPPING.member(
    "Phi3ForCausalLM",
    weights=WEIGHTS,
    tiny_configs={"phi3": tiny_config},
    hf_recorder="hf_decoder",
)
