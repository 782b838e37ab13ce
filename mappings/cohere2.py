"""Cohere Command R7B / Command A (``Cohere2ForCausalLM``) as vLLM builds it, in TransformerLens
names.

Command R's parallel block (``cohere.py``: one LayerNorm without bias before attention and MLP,
logits times ``logit_scale``) with layers of two kinds, as ``config.layer_types`` says: sliding
layers attend over a window of recent keys and rotate q and k (in pairs, interleaved); full
layers attend over every key and rotate nothing. One layer (``model.layers.{layer}``)::

    residual = hidden                                    # resid_pre
    hidden, _ = input_layernorm(hidden, residual)        # centred, weight only
    self_attn(positions, hidden):
        q, k, v = qkv_proj(hidden)[0].split(...)
        if sliding layer:
            q, k = rotary_emb(positions, q, k)           # attn.hook_rot_q, attn.hook_rot_k
        z = attn(q, k, v)                                # sliding: the last window_keys keys
    mlp = mlp(hidden)                                    # the same normed input
    return residual + (attn + mlp), residual             # resid_post is the first

On full layers ``hook_rot_q``/``hook_rot_k`` are q and k as projected. Scores and patterns are
rebuilt with each layer's window; hooks on them and on per-head results cannot run explicitly.

Where vLLM differs from HuggingFace: from vLLM 0.29 on, vLLM's sliding layers attend over
``sliding_window + 1`` keys (the query's own and the ``sliding_window`` before it, Cohere's
training convention as vLLM reads it), HuggingFace's over ``sliding_window`` (the query's own and
``sliding_window - 1`` before it); vLLM 0.26 to 0.28 attend over ``sliding_window``, as
HuggingFace (:func:`window_keys` follows the vLLM it runs on). The names here are vLLM's values,
and the rebuilt scores and patterns use vLLM's window, so that they are the attention vLLM
computed. With the wider window the two agree on every position closer to the start than the
window; past it, each sliding layer's query sees one key more than in HuggingFace: on the tiny
checkpoint in fp32 (window 8, the parity prompts of 4 to 44 tokens) ``blocks.0.attn.hook_z`` then
differs from HuggingFace's by up to 1.26 relative per token and the logits by up to 0.85 (its
random weights attend sharply); a real checkpoint's window is 4096 keys, so only longer prompts
differ. The parity reference therefore runs HuggingFace's Cohere2 with the window vLLM attends
over (``parity/hf_cohere2.py``), and TransformerLens's bridge, which runs HuggingFace's window, is
no reference for it.

As in ``cohere.py``, there is no ``hook_resid_mid``, ``hook_mlp_in`` or ``ln2``, and checkpoints
with ``use_qk_norm`` are refused.
"""

from transformers import Cohere2Config, PretrainedConfig

from vlens.mappings import cohere
from vlens.mappings._tiny import rotary_dims
from vlens.mappings.gemma2 import LayerAttentionScores
from vlens.mappings.llama import BLOCK
from vlens.names.mapping import (
    DerivedSpec,
    NoExplicitAttention,
    Spec,
    attention_dimensions,
    attention_pattern,
    names_after,
)

#: Shorter than most parity prompts, so that the window is exercised.
TINY_WINDOW = 8

NOT_EXPLICIT = NoExplicitAttention(
    "Cohere 2 attends over a sliding window on some layers, which vlens's explicit attention "
    "does not compute; hook attn.hook_rot_q, attn.hook_rot_k, attn.hook_v or attn.hook_z instead"
)

WINDOW_BRIDGE = (
    "vLLM's sliding layers of Cohere 2 attend over sliding_window + 1 keys (from vLLM 0.29 on) and "
    "TransformerLens's bridge (HuggingFace's Cohere2) over sliding_window, so past the window the "
    "bridge computes another attention than the one served"
)

#: The first vLLM whose sliding layers attend over one key more than ``sliding_window``.
WINDOW_PLUS_ONE_SINCE = (0, 29)


def window_keys(config: PretrainedConfig) -> int:
    """How many keys the vLLM installed attends over on a sliding layer: ``sliding_window + 1``
    from vLLM 0.29 on, ``sliding_window`` (as HuggingFace) before."""
    import vllm
    from packaging.version import Version

    plus_one = Version(vllm.__version__).release[:2] >= WINDOW_PLUS_ONE_SINCE
    return config.sliding_window + int(plus_one)


def layer_windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    """Each layer's window as vLLM attends over it: :func:`window_keys` on sliding layers, None
    (every key) on full ones."""
    keys = window_keys(config)
    return tuple(keys if kind == "sliding_attention" else None for kind in config.layer_types)


def hook_specs(config: PretrainedConfig) -> dict[str, Spec]:
    """Command R's names with scores and patterns rebuilt per layer: windowed on sliding layers,
    fully causal on the others."""
    specs = cohere.hook_specs(config)
    _, _, d_head = attention_dimensions(config)
    specs.pop(f"{BLOCK}.attn.hook_attn_scores", None)
    specs.pop(f"{BLOCK}.attn.hook_pattern", None)
    scores = DerivedSpec(
        (f"{BLOCK}.attn.hook_rot_q", f"{BLOCK}.attn.hook_rot_k"),
        LayerAttentionScores(d_head**-0.5, None, layer_windows(config)),
        "head query_pos key_pos",
        hookable=NOT_EXPLICIT,
    )
    return names_after(specs, f"{BLOCK}.attn.hook_rot_k", {
        f"{BLOCK}.attn.hook_attn_scores": scores,
        f"{BLOCK}.attn.hook_pattern": attention_pattern(
            f"{BLOCK}.attn.hook_attn_scores", NOT_EXPLICIT
        ),
    })


def tiny_config() -> PretrainedConfig:
    """Command R7B's layout: sliding layers around a full one, GQA, tied unembedding, logits scaled
    by a factor away from 1."""
    return Cohere2Config(
        **rotary_dims(),
        layer_norm_eps=1e-5,
        logit_scale=0.5,
        sliding_window=TINY_WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )


MAPPING = cohere.MAPPING.member(
    "Cohere2ForCausalLM",
    hook_specs=hook_specs,
    tiny_configs={"cohere2": tiny_config},
    hf_recorder="hf_cohere2",
    no_bridge_reference=WINDOW_BRIDGE,
)
