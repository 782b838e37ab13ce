"""Reading single tensors from a checkpoint's safetensors files.

vLLM's CPU backend repacks linear weights after loading and leaves ``layer.weight`` empty, so any
weight vlens needs in the user's process (``W_U``, ``W_O``, norm weights) comes from the files.
"""

from __future__ import annotations

import json
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

    def __getitem__(self, name: str) -> Tensor:
        if name not in self.file_of:
            raise KeyError(f"{name!r} is not in the checkpoint at {self.folder}")
        with safe_open(self.file_of[name], framework="pt") as handle:
            return handle.get_tensor(name)


@dataclass(frozen=True)
class WeightNames:
    """Where TransformerLens's weight views (``W_O``, ``W_out``, ``W_U`` and their biases) live
    in an architecture's checkpoint; names may contain ``{layer}``.

    Linear weights are stored ``[out, in]``; ``conv1d`` says the checkpoint stores them
    ``[in, out]`` (GPT-2). ``W_U`` lists candidates: tied models have only the embedding.
    """

    normalization: Literal["RMS", "LN"]
    eps: str  # the config attribute holding the norms' epsilon
    W_O: str
    W_out: str
    W_U: tuple[str, ...]
    ln_final_w: str
    ln_final_b: str | None = None
    b_O: str | None = None
    b_out: str | None = None
    b_U: str | None = None
    conv1d: bool = False
