"""OLMo-3 (``Olmo3ForCausalLM``) on vLLM's Transformers backend
(:mod:`vlens.mappings._transformers`): OLMo-2's block (post-norms, q/k norms over the whole
projections, the same checkpoint names), with sliding-window attention on the layers
``config.layer_types`` marks ``sliding_attention`` and a rotary embedding per layer type. Where
the window is shorter than the context, scores and patterns are not offered (they would be
rebuilt with full causal attention).
"""

from transformers import Olmo3Config, PretrainedConfig

from vlens.mappings._tiny import rotary_dims
from vlens.mappings._transformers import Details, transformers_backend_mapping
from vlens.mappings.olmo2 import WEIGHTS

#: Shorter than most parity prompts, so that the window is exercised.
TINY_WINDOW = 8


def tiny_config() -> PretrainedConfig:
    """OLMo-3: windowed, full and windowed layers."""
    return Olmo3Config(
        **rotary_dims(),
        rms_norm_eps=1e-6,
        sliding_window=TINY_WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )


MAPPING = transformers_backend_mapping(
    "Olmo3ForCausalLM",
    details=Details(eps="rms_norm_eps"),
    weights=WEIGHTS,
    tiny_configs={"olmo3": tiny_config},
)
