"""Cohere Command R (``CohereForCausalLM``) as vLLM builds it, in TransformerLens names.

Llama's attention and gated MLP modules (``llama.py``: ``qkv_proj``, ``rotary_emb``, ``attn``,
``o_proj``; ``gate_up_proj``, ``down_proj``) in a parallel block behind one LayerNorm without a
bias, and logits multiplied by ``config.logit_scale``. One layer (``model.layers.{layer}``,
called ``layer(positions, hidden, residual)``; the residual argument is not read)::

    residual = hidden                                    # resid_pre
    hidden, _ = input_layernorm(hidden, residual)        # centred, weight only
    attn = self_attn(positions, hidden)                  # q, k rotated in pairs (interleaved)
    mlp = mlp(hidden)                                    # the same normed input
    return residual + (attn + mlp), residual             # resid_post is the first

Under tensor parallelism vLLM all-reduces ``attn + mlp`` once, so each rank's ``hook_attn_out``
and ``hook_mlp_out`` are partial sums until then (marked :class:`PartialSums`: read summed, an
edit's difference added to rank 0's part).

After the last layer ``model.norm`` (the same LayerNorm) gives what the logits processor unembeds
with the tied embedding, times ``logit_scale``: ``unembed.hook_out`` is those scaled logits, as
HuggingFace's. As in TransformerLens's bridge for a block with one norm before both halves, there
is no ``hook_resid_mid``, ``hook_mlp_in`` or ``ln2`` (see
:func:`~vlens.mappings.gptj.parallel_block_error`).

Checkpoints with ``use_qk_norm`` (Command R+: q and k normed per head before the rotary) are
refused: ``hook_rot_q``/``hook_rot_k`` would be read after a norm this mapping does not name.
"""

import dataclasses

from transformers import CohereConfig, PretrainedConfig

from vlens.mappings import llama
from vlens.mappings._tiny import rotary_dims
from vlens.mappings.gptj import parallel_block_error
from vlens.mappings.llama import ATTN, BLOCK, LAYER, MLP, ResidualStream
from vlens.names.mapping import (
    Argument,
    PartialSums,
    Spec,
    entering,
    layer_norm_normalized,
    layer_norm_scale,
    leaving,
)

#: The names of a sequential block that a parallel one has no value for.
SEQUENTIAL_ONLY = ("hook_resid_mid", "hook_mlp_in", "ln2.hook_scale", "ln2.hook_normalized")


def residual_stream(eps: float) -> ResidualStream:
    """The stream as the layer's argument and first result and the final norm's input."""
    pre = entering(LAYER, Argument(1, "hidden_states"))
    return ResidualStream(
        pre=pre,
        mid=pre,  # no stream between attention and MLP: its names are removed below
        post=leaving(LAYER, element=0),
        final=entering("model.norm", Argument(0, "hidden_states")),
        final_normed=leaving("model.norm", element=0),
        eps=eps,
        scale=layer_norm_scale,
        normalized=layer_norm_normalized,
    )


def hook_specs(config: PretrainedConfig) -> dict[str, Spec]:
    if getattr(config, "use_qk_norm", False):
        raise NotImplementedError(
            "this Cohere checkpoint norms q and k per head (use_qk_norm=True, Command R+), "
            "which this mapping does not name; only checkpoints without it are served"
        )
    specs = llama.decoder_specs(config, residual_stream(config.layer_norm_eps))
    for name in SEQUENTIAL_ONLY:
        del specs[f"{BLOCK}.{name}"]
    specs[f"{BLOCK}.hook_attn_out"] = leaving(ATTN, shards=PartialSums())
    specs[f"{BLOCK}.hook_mlp_out"] = leaving(MLP, shards=PartialSums())
    return specs


def tiny_config() -> PretrainedConfig:
    """Command R: GQA, tied unembedding, logits scaled by a factor away from 1."""
    return CohereConfig(**rotary_dims(), layer_norm_eps=1e-5, logit_scale=0.5, use_qk_norm=False)


WEIGHTS = dataclasses.replace(
    llama.WEIGHTS, normalization="LN", eps="layer_norm_eps", ln2_w=None, logit_scale="logit_scale"
)

MAPPING = llama.MAPPING.member(
    "CohereForCausalLM",
    hook_specs=hook_specs,
    weights=WEIGHTS,
    tensor_parallel=True,
    unavailable=parallel_block_error,
    tiny_configs={"cohere": tiny_config},
    hf_recorder="hf_decoder",
)
