"""An SAE's settings, read from the ``cfg.json`` that SAELens saves beside its weights.

SAELens 6 writes the architecture's settings at the top level (``architecture``, ``d_in``,
``d_sae``, ``dtype``, ``apply_b_dec_to_input``, ``normalize_activations``,
``reshape_activations``; TopK adds ``k`` and ``rescale_acts_by_decoder_norm``) and what it
knows about the model it was trained on under ``metadata`` (``hook_name``, ``hook_head_index``,
``model_name``, ``sae_lens_version``, ...). Files written before SAELens 6 keep everything at
the top level, with older names (``hook_point``, ``activation_fn_str``, a boolean
``normalize_activations``); :meth:`SAEConfig.from_dict` reads both, as SAELens does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

CFG_FILENAME = "cfg.json"
WEIGHTS_FILENAME = "sae_weights.safetensors"
SPARSITY_FILENAME = "sparsity.safetensors"

ARCHITECTURES = ("standard", "jumprelu", "topk", "gated")

# What each mode does is in vlens.sae.normalize; the three that do nothing at inference are
# statistics that SAELens folds into the weights (or expects applied to the input).
NORMALIZATIONS = (
    "none",
    "expected_average_only_in",
    "covariance_whitening",
    "constant_norm_rescale",
    "layer_norm",
)
RESHAPES = ("none", "hook_z")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

_FOLDER_HELP = (
    f"a SAELens SAE folder holds {CFG_FILENAME} (its settings) and {WEIGHTS_FILENAME} (its "
    f"weights), as SAELens's save_model writes them"
)


class Metadata(Mapping[str, Any]):
    """What an SAE's file records about training and the model, read as SAELens's
    ``SAEMetadata`` reads: ``cfg.metadata.hook_name`` and ``cfg.metadata["hook_name"]`` alike,
    None for a key the file does not have (``in``, ``keys()`` and ``get`` see only those it
    has)."""

    def __init__(self, values: Mapping[str, Any] | None = None) -> None:
        object.__setattr__(self, "_values", dict(values or {}))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return self._values.get(name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("an SAE's metadata is read-only")

    def __getitem__(self, key: str) -> Any:
        return self._values.get(key)

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def get(self, key: str, default: Any = None) -> Any:
        return self._values.get(key, default)

    def to_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and self._values == dict(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Metadata({self._values!r})"


class SAEFormatError(ValueError):
    """A folder or a config that is not an SAE in SAELens's format, or one vlens cannot run."""


@dataclass(frozen=True)
class SAEConfig:
    """What encode and decode need, and where the SAE reads from in the model.

    ``hook_name`` is the TransformerLens name of the activation the SAE was trained on (None
    when the file does not say); ``metadata`` keeps everything else the file records about
    training, unread, read as SAELens's ``cfg.metadata`` is (:class:`Metadata`).
    """

    architecture: str
    d_in: int
    d_sae: int
    dtype: str = "float32"
    hook_name: str | None = None
    hook_head_index: int | None = None
    apply_b_dec_to_input: bool = True
    normalize_activations: str = "none"
    reshape_activations: str = "none"
    k: int | None = None
    rescale_acts_by_decoder_norm: bool = False
    model_name: str | None = None
    metadata: Metadata = field(default_factory=Metadata, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.metadata, Metadata):  # a dict given by hand
            object.__setattr__(self, "metadata", Metadata(self.metadata))
        if self.architecture not in ARCHITECTURES:
            raise SAEFormatError(
                f"architecture {self.architecture!r} is not supported; vlens runs SAELens's "
                f"{', '.join(ARCHITECTURES)}"
            )
        for name in ("d_in", "d_sae"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SAEFormatError(f"{name} must be a positive integer, not {value!r}")
        if self.dtype not in DTYPES:
            raise SAEFormatError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.normalize_activations not in NORMALIZATIONS:
            raise SAEFormatError(
                f"normalize_activations {self.normalize_activations!r} is not supported; "
                f"vlens runs {', '.join(NORMALIZATIONS)}"
            )
        if self.reshape_activations not in RESHAPES:
            raise SAEFormatError(
                f"reshape_activations {self.reshape_activations!r} is not one of "
                f"{', '.join(RESHAPES)}"
            )
        if self.reshape_activations == "hook_z" and not (self.hook_name or "_z").endswith("_z"):
            raise SAEFormatError(
                f"reshape_activations 'hook_z' flattens attention heads, but the SAE reads "
                f"{self.hook_name!r}, which is not a hook_z activation"
            )
        if self.architecture == "topk" and not (
            isinstance(self.k, int) and 1 <= self.k <= self.d_sae
        ):
            raise SAEFormatError(
                f"a topk SAE needs k, the number of features kept, between 1 and d_sae "
                f"({self.d_sae}); the config gives {self.k!r}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> SAEConfig:
        """Read a ``cfg.json``'s contents, of SAELens 6 or of an earlier SAELens."""
        cfg = dict(raw) if _is_sae_lens_6(raw) else _from_pre_6(raw)
        metadata = dict(cfg.get("metadata") or {})

        def about_model(key: str) -> Any:
            # SAELens 6 keeps these under metadata; a hand-written or converted file may not.
            return metadata[key] if metadata.get(key) is not None else cfg.get(key)

        missing = [key for key in ("d_in", "d_sae") if key not in cfg]
        if missing:
            raise SAEFormatError(f"the SAE config lacks {', '.join(missing)}")
        architecture = cfg.get("architecture", "standard")
        return cls(
            architecture=architecture,
            d_in=cfg["d_in"],
            d_sae=cfg["d_sae"],
            dtype=_dtype_name(cfg.get("dtype", "float32")),
            hook_name=about_model("hook_name"),
            hook_head_index=about_model("hook_head_index"),
            apply_b_dec_to_input=bool(cfg.get("apply_b_dec_to_input", True)),
            normalize_activations=cfg.get("normalize_activations") or "none",
            reshape_activations=cfg.get("reshape_activations") or "none",
            k=cfg.get("k") if architecture == "topk" else None,
            rescale_acts_by_decoder_norm=bool(cfg.get("rescale_acts_by_decoder_norm", False)),
            model_name=about_model("model_name"),
            metadata=Metadata(metadata),
        )

    @classmethod
    def read(cls, folder: str | Path) -> SAEConfig:
        """Read ``folder/cfg.json``, saying what a SAELens SAE folder holds when it is not one."""
        folder = Path(folder)
        path = folder / CFG_FILENAME
        if not path.is_file():
            raise SAEFormatError(f"{folder} has no {CFG_FILENAME}; {_FOLDER_HELP}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise SAEFormatError(f"{path} is not valid JSON ({error})") from None
        if not isinstance(raw, dict):
            raise SAEFormatError(f"{path} holds {type(raw).__name__}, not an SAE's settings")
        try:
            return cls.from_dict(raw)
        except SAEFormatError as error:
            raise SAEFormatError(f"{path}: {error}") from None


def check_folder(folder: str | Path) -> Path:
    """``folder`` as a Path, once it is known to hold both files of a SAELens SAE."""
    folder = Path(folder)
    if not folder.is_dir():
        raise SAEFormatError(f"{folder} is not a folder; {_FOLDER_HELP}")
    missing = [name for name in (CFG_FILENAME, WEIGHTS_FILENAME) if not (folder / name).is_file()]
    if missing:
        raise SAEFormatError(f"{folder} has no {' and no '.join(missing)}; {_FOLDER_HELP}")
    return folder


def _dtype_name(value: Any) -> Any:
    """SAELens accepts both "float32" and "torch.float32"."""
    return value.removeprefix("torch.") if isinstance(value, str) else value


def _is_sae_lens_6(raw: Mapping[str, Any]) -> bool:
    """SAELens decides by the version that wrote the file: at the top level before 6, under
    metadata from 6 on; a file that names none is taken as older."""
    metadata = raw.get("metadata") if isinstance(raw.get("metadata"), Mapping) else {}
    version = raw.get("sae_lens_version") or metadata.get("sae_lens_version")
    if not version:
        return False
    major = str(version).split(".", 1)[0]
    return major.isdigit() and int(major) >= 6


def _from_pre_6(raw: Mapping[str, Any]) -> dict[str, Any]:
    """An earlier SAELens's config in SAELens 6's terms, with SAELens 6's defaults for what
    older files leave out."""
    renamed = {"hook_point": "hook_name", "hook_point_head_index": "hook_head_index",
               "activation_fn_str": "activation_fn"}
    cfg = {renamed.get(key, key): value for key, value in raw.items()}
    cfg.setdefault("architecture", "standard")
    cfg.setdefault("apply_b_dec_to_input", True)
    cfg.setdefault(
        "reshape_activations", "hook_z" if "hook_z" in (cfg.get("hook_name") or "") else "none"
    )
    kwargs = cfg.get("activation_fn_kwargs") or {}
    if cfg.get("activation_fn") == "topk" and kwargs.get("k") is not None:
        cfg["architecture"] = "topk"
    if cfg["architecture"] == "topk" and kwargs.get("k") is not None:
        cfg["k"] = kwargs["k"]
    normalize = cfg.get("normalize_activations")
    if isinstance(normalize, bool):
        cfg["normalize_activations"] = "expected_average_only_in" if normalize else "none"
    return cfg
