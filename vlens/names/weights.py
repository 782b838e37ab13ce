"""Reading single tensors from a checkpoint's safetensors files.

vLLM's CPU backend repacks linear weights after loading and leaves ``layer.weight`` empty, so any
weight vlens needs in the user's process (``W_U``, ``W_O``, norm weights) comes from the files.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal

from safetensors import safe_open
from torch import Tensor


class CheckpointWeights:
    """Lazy access to the tensors of a local HuggingFace checkpoint, by their HuggingFace names."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)

    @cached_property
    def file_of(self) -> dict[str, Path]:
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: self.folder / file for name, file in weight_map.items()}
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {self.folder}")
        names: dict[str, Path] = {}
        for file in files:
            with safe_open(file, framework="pt") as handle:
                names.update(dict.fromkeys(handle.keys(), file))
        return names

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def parameter_count(self) -> int:
        """How many numbers the checkpoint's tensors hold, read from the files' headers."""
        count = 0
        for file in sorted(set(self.file_of.values())):
            with safe_open(file, framework="pt") as handle:
                count += sum(math.prod(handle.get_slice(name).get_shape()) for name in handle.keys())
        return count

    def __getitem__(self, name: str) -> Tensor:
        if name not in self.file_of:
            raise KeyError(f"{name!r} is not in the checkpoint at {self.folder}")
        with safe_open(self.file_of[name], framework="pt") as handle:
            return handle.get_tensor(name)


@dataclass(frozen=True, kw_only=True)
class WeightNames:
    """Where TransformerLens's weight views (``W_E``, ``W_Q``... ``W_U``, norm weights) live in an
    architecture's checkpoint; per-layer names contain ``{layer}``. A name left None is a weight
    the architecture does not have (a bias-free projection, an ungated MLP); the views say so as
    TransformerLens does.

    Linear weights are stored ``[out, in]``; ``conv1d`` says the checkpoint stores them
    ``[in, out]`` (GPT-2). ``W_U`` lists candidates: tied models have only the embedding.
    ``W_QKV`` (``b_QKV``) names one fused projection instead of ``W_Q``, ``W_K``, ``W_V``: its
    outputs are ``[q | k | v]``, ``n_heads``, ``n_kv_heads`` and ``n_kv_heads`` heads of
    ``d_head`` (GPT-2's ``c_attn``). ``optional_prefix``: a prefix some checkpoints of the
    architecture leave out of every name (GPT-2 as published: ``h.0.attn.c_attn.weight``).
    """

    normalization: Literal["RMS", "LN"]
    #: The config attribute holding the norms' epsilon, or the epsilon itself where the config
    #: has none (OPT's norms are torch's LayerNorm with its default).
    eps: str | float
    W_E: str
    W_pos: str | None = None
    W_Q: str | None = None
    W_K: str | None = None
    W_V: str | None = None
    W_QKV: str | None = None
    b_Q: str | None = None
    b_K: str | None = None
    b_V: str | None = None
    b_QKV: str | None = None
    W_O: str
    b_O: str | None = None
    W_in: str | None = None  # None: no single one per layer (a mixture of experts)
    W_gate: str | None = None
    b_in: str | None = None
    W_out: str | None = None
    b_out: str | None = None
    ln1_w: str | None = None  # None: no norm before the attention (OLMo-2's post-norms)
    ln1_b: str | None = None
    ln2_w: str | None = None
    ln2_b: str | None = None
    ln_final_w: str
    ln_final_b: str | None = None
    W_U: tuple[str, ...]
    b_U: str | None = None
    conv1d: bool = False
    #: ``W_gate`` and ``W_in`` both name one fused projection whose outputs are ``[gate | up]``,
    #: ``d_mlp`` each (Phi-3's and GLM-4's ``gate_up_proj``): ``W_gate`` is its first half.
    fused_gate_up: bool = False
    #: ``W_QKV``'s outputs are each head's ``[q | k | v]`` side by side instead (GPT-NeoX's
    #: ``query_key_value``; every head has its own key and value).
    qkv_per_head: bool = False
    optional_prefix: str | None = None
    #: What every norm adds to its stored weight before scaling by it (Gemma's ``GemmaRMSNorm``
    #: scales by ``1 + weight``: 1.0).
    norm_offset: float = 0.0
    #: The config attribute holding the logits' soft cap (``cap·tanh(logits / cap)``, Gemma 2's
    #: ``final_logit_softcapping``), where the architecture caps them.
    logit_soft_cap: str | None = None
    #: The config attribute the logits are divided by, before any soft cap (Granite's
    #: ``logits_scaling``), where the architecture scales them.
    logit_divisor: str | None = None
    #: The config attribute the logits are multiplied by (Cohere's ``logit_scale``), where the
    #: architecture scales them so.
    logit_scale: str | None = None
