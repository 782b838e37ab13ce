"""SAELens's sparse autoencoders, run from the folders SAELens saves, without SAELens.

``SAE.load_from_disk(folder)`` reads ``cfg.json`` and ``sae_weights.safetensors``; the module
has SAELens's attribute names (``cfg``, ``W_enc``, ``W_dec``, ``b_enc``, ``b_dec``,
``threshold``, ``b_gate``, ``b_mag``, ``r_mag``) and computes what SAELens's ``encode``,
``decode`` and ``forward`` compute. :meth:`SAE.stages` gives, in one pass, every value that
SAELens's hook points inside the SAE see (``hook_sae_input`` ... ``hook_sae_output``).

One pass, in SAELens's order::

    hook_sae_input     x in the SAE's dtype; [..., n_heads, d_head] flattened for hook_z
    (normalise)        x' = norm(x) (vlens.sae.normalize), minus b_dec if apply_b_dec_to_input
    hook_sae_acts_pre  h = x' W_enc + b_enc
                       (gated: the magnitude path, x' (W_enc ⊙ exp(r_mag)) + b_mag)
    hook_sae_acts_post f = act(h)              (vlens.sae.activations)
    hook_sae_recons    f W_dec + b_dec
                       (topk with rescale_acts_by_decoder_norm: f / ‖W_dec rows‖ first)
    (restore)          the normalisation undone, heads unflattened: the decoded x̂
    hook_sae_error     x − x̂                   (only with use_error_term)
    hook_sae_output    x̂, or x̂ + (x − x̂) with use_error_term
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from vlens.sae import activations, pretrained
from vlens.sae.config import DTYPES, SAEConfig, SAEFormatError, check_folder
from vlens.sae.normalize import Restore, normalize
from vlens.sae.weights import ALL_WEIGHT_NAMES, check_weights, read_weights, weight_shapes

# An SAE's input: a vector of d_in, or for a hook_z SAE one vector per attention head.
SAEInput = Float[Tensor, "... d_in"] | Float[Tensor, "... n_heads d_head"]

#: A hook point inside the SAE: sees a stage's value by its hook name, returns the value to
#: go on with.
Visit = Callable[[str, Tensor], Tensor]

HOOK_NAMES = (
    "hook_sae_input",
    "hook_sae_acts_pre",
    "hook_sae_acts_post",
    "hook_sae_recons",
    "hook_sae_error",
    "hook_sae_output",
)


@dataclass(frozen=True, eq=False)
class Encoded:
    """What one encode computed, and what decoding its features back needs."""

    sae_in: Float[Tensor, "... d_in"]
    acts_pre: Float[Tensor, "... d_sae"]
    acts_post: Float[Tensor, "... d_sae"]
    restore: Restore
    d_head: int | None


class SAE(nn.Module):
    """A sparse autoencoder in SAELens's terms (see the module's docstring for the formulas).

    The parameters are frozen (vlens reads SAEs, it does not train them; ``requires_grad_()``
    unfreezes them); gradients still flow to the input. ``use_error_term`` makes
    :meth:`forward` return the input itself, up to rounding, with the SAE's error as its own
    term, as SAELens's does.
    """

    #: the hook points inside the SAE, in the order a pass reaches them
    hook_names = HOOK_NAMES

    cfg: SAEConfig
    W_enc: nn.Parameter
    W_dec: nn.Parameter
    b_dec: nn.Parameter
    b_enc: nn.Parameter | None
    threshold: nn.Parameter | None
    b_gate: nn.Parameter | None
    b_mag: nn.Parameter | None
    r_mag: nn.Parameter | None

    def __init__(
        self,
        cfg: SAEConfig,
        weights: Mapping[str, Tensor] | None = None,
        use_error_term: bool = False,
    ) -> None:
        """An SAE of ``cfg`` with ``weights`` (named as in SAELens's files; zeros if None)."""
        super().__init__()
        self.cfg = cfg
        self.use_error_term = use_error_term
        shapes = weight_shapes(cfg)
        if weights is None:
            weights = {name: torch.zeros(shape) for name, shape in shapes.items()}
        check_weights(dict(weights), cfg, where="the weights given")
        for name in ALL_WEIGHT_NAMES:
            value = weights.get(name) if name in shapes else None
            parameter = None
            if value is not None:
                parameter = nn.Parameter(value.to(cfg.torch_dtype), requires_grad=False)
            self.register_parameter(name, parameter)
        # What the last encode measured, which decode needs to undo (as in SAELens, whose
        # decode also reads the statistics of the last encode).
        self._restore: Restore | None = None
        self.d_head: int | None = None

    @classmethod
    def load_from_disk(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
    ) -> SAE:
        """The SAE that SAELens saved in ``path``, on ``device``, in ``dtype`` (the file's when
        None). SAELens's classmethod of the same name, for its folders."""
        folder = check_folder(path)
        cfg = SAEConfig.read(folder)
        if dtype is not None:
            name = dtype if isinstance(dtype, str) else _dtype_name(dtype)
            cfg = replace(cfg, dtype=name.removeprefix("torch."))
        return cls(cfg, read_weights(folder, cfg, device)).eval()

    @classmethod
    def from_pretrained(
        cls,
        release: str,
        sae_id: str,
        device: str | torch.device = "cpu",
        dtype: str = "float32",
        force_download: bool = False,
        fold_W_dec_norm: bool = False,
    ) -> SAE:
        """A published SAE by SAELens's names (SAELens's classmethod of the same name): resolved
        and downloaded by SAELens where it is installed, else ``release`` read as a HuggingFace
        repository holding ``sae_id`` in SAELens's format (:mod:`vlens.sae.pretrained`).
        Offline, refused with the folder to load instead."""
        if pretrained.sae_lens_installed():
            return cls.of(pretrained.from_sae_lens(
                release, sae_id, device=str(device), dtype=dtype, force_download=force_download,
                fold_W_dec_norm=fold_W_dec_norm,
            ))
        sae = cls.load_from_disk(
            pretrained.hub_folder(release, sae_id, force_download), device, dtype
        )
        if fold_W_dec_norm:
            sae.fold_W_dec_norm()
        return sae

    @classmethod
    def of(cls, sae: Any) -> SAE:
        """``sae`` as vlens's SAE: itself, or a SAELens 6 ``SAE`` read through its public
        surface (``cfg.to_dict()``, its parameters, ``use_error_term``), its tensors shared,
        not copied. Architectures vlens does not run (transcoders among them) are refused
        with the reason."""
        if isinstance(sae, SAE):
            return sae
        to_dict = getattr(getattr(sae, "cfg", None), "to_dict", None)
        if not isinstance(sae, nn.Module) or to_dict is None:
            raise TypeError(
                f"expected an SAE (vlens's, or SAELens's), got {type(sae).__name__}; "
                f"SAE.load_from_disk(folder) reads a folder SAELens saved"
            )
        raw = dict(to_dict())
        metadata = raw.get("metadata") or {}
        metadata = dict(metadata.to_dict() if hasattr(metadata, "to_dict") else metadata)
        metadata.setdefault("sae_lens_version", "6")  # a SAELens 6 object, whatever it records
        raw["metadata"] = metadata
        cfg = SAEConfig.from_dict(raw)
        tensors = {name: value.detach() for name, value in sae.state_dict().items()}
        return cls(cfg, tensors, bool(getattr(sae, "use_error_term", False))).eval()

    def fold_W_dec_norm(self) -> None:
        """Scale each feature so that its decoder row has unit norm, the SAE's output unchanged
        (SAELens's method of the same name): the encoder's column, bias and threshold grow by
        the norm the decoder row loses."""
        if self.cfg.architecture not in ("standard", "jumprelu"):
            raise NotImplementedError(
                f"fold_W_dec_norm of a {self.cfg.architecture} SAE: folding changes which "
                f"features a {self.cfg.architecture} SAE keeps; vlens folds standard and "
                f"jumprelu SAEs"
            )
        with torch.no_grad():
            norms = self.W_dec.norm(dim=-1)
            self.W_dec.div_(norms[:, None])
            self.W_enc.mul_(norms)
            for name in ("b_enc", "threshold"):
                value = getattr(self, name)
                if value is not None:
                    value.mul_(norms)

    @property
    def dtype(self) -> torch.dtype:
        return self.W_enc.dtype

    @property
    def device(self) -> torch.device:
        return self.W_enc.device

    def encode(self, x: SAEInput) -> Float[Tensor, "... d_sae"]:
        """The feature activations of ``x`` (what SAELens's ``hook_sae_acts_post`` sees)."""
        encoded = self._encode(x)
        self._restore, self.d_head = encoded.restore, encoded.d_head
        return encoded.acts_post

    def decode(
        self, feature_acts: Float[Tensor, "... d_sae"], d_head: int | None = None
    ) -> SAEInput:
        """The reconstruction of ``feature_acts``: ``f W_dec + b_dec``, with the input
        normalisation of the last :meth:`encode` undone and, for a hook_z SAE, the heads
        unflattened (``d_head`` given, or the last encoded input's)."""
        restore = self._restore
        if restore is None:
            if self.cfg.normalize_activations in ("constant_norm_rescale", "layer_norm"):
                raise RuntimeError(
                    f"decode undoes the {self.cfg.normalize_activations} of the input, whose "
                    f"statistics the last encode measured: call encode first (or use forward)"
                )
            restore = Restore()
        return self._finish(self._linear_decode(feature_acts), restore, d_head or self.d_head)

    def forward(self, x: SAEInput) -> SAEInput:
        """``decode(encode(x))``, plus the error term ``x − decode(encode(x))`` when
        ``use_error_term`` (what SAELens's ``hook_sae_output`` sees)."""
        return self.stages(x)["hook_sae_output"]

    def stages(self, x: SAEInput) -> dict[str, Tensor]:
        """Every value SAELens's hook points inside the SAE would record for ``x``, by hook name,
        in the order they run: ``hook_sae_input``, ``hook_sae_acts_pre``, ``hook_sae_acts_post``,
        ``hook_sae_recons``, ``hook_sae_error`` (only with ``use_error_term``),
        ``hook_sae_output``."""
        values: dict[str, Tensor] = {}

        def record(stage: str, value: Tensor) -> Tensor:
            values[stage] = value
            return value

        self.run(x, record)
        return values

    def run(self, x: SAEInput, visit: Visit, use_error_term: bool | None = None) -> SAEInput:
        """One forward pass of ``x`` in SAELens's order, handing each ``hook_sae_*`` value to
        ``visit(stage, value)`` as it is made and going on with what ``visit`` returns, as
        SAELens's hook points inside the SAE do: an edit of ``hook_sae_acts_post`` is decoded.
        The error term (``use_error_term``, else the SAE's own setting) comes from a second,
        unvisited pass of ``x``, as SAELens computes it with its hooks disabled, so that edited
        features survive in the output."""
        sae_in, d_head = x.to(self.dtype), None
        if self.cfg.reshape_activations == "hook_z":
            d_head = sae_in.shape[-1]
            sae_in = self._flatten_heads(sae_in)
        sae_in = visit("hook_sae_input", sae_in)
        normed, restore = normalize(sae_in, self.cfg.normalize_activations, self.cfg.d_in)
        if self.cfg.apply_b_dec_to_input:
            normed = normed - self.b_dec
        pre, gate_pre = self._pre_activations(normed)
        pre = visit("hook_sae_acts_pre", pre)
        post = visit("hook_sae_acts_post", self._activation(pre, gate_pre))
        recons = visit("hook_sae_recons", self._linear_decode(post))
        output = self._finish(recons, restore, d_head)
        if self.use_error_term if use_error_term is None else use_error_term:
            clean = self._encode(x)
            clean_output = self._finish(
                self._linear_decode(clean.acts_post), clean.restore, clean.d_head
            )
            output = output + visit("hook_sae_error", x - clean_output)
        return visit("hook_sae_output", output)

    def _encode(self, x: SAEInput) -> Encoded:
        sae_in, d_head = x.to(self.dtype), None
        if self.cfg.reshape_activations == "hook_z":
            d_head = sae_in.shape[-1]
            sae_in = self._flatten_heads(sae_in)
        normed, restore = normalize(sae_in, self.cfg.normalize_activations, self.cfg.d_in)
        if self.cfg.apply_b_dec_to_input:
            normed = normed - self.b_dec
        pre, gate_pre = self._pre_activations(normed)
        return Encoded(sae_in, pre, self._activation(pre, gate_pre), restore, d_head)

    def _pre_activations(
        self, x: Float[Tensor, "... d_in"]
    ) -> tuple[Float[Tensor, "... d_sae"], Float[Tensor, "... d_sae"] | None]:
        """``h``, the pre-activations SAELens's ``hook_sae_acts_pre`` sees (a gated SAE's
        magnitude path), and a gated SAE's gate pre-activations (None for the others)."""
        if self.cfg.architecture == "gated":
            gate_pre = x @ self.W_enc + self.b_gate
            return x @ (self.W_enc * self.r_mag.exp()) + self.b_mag, gate_pre
        return x @ self.W_enc + self.b_enc, None

    def _activation(
        self, pre: Float[Tensor, "... d_sae"], gate_pre: Float[Tensor, "... d_sae"] | None
    ) -> Float[Tensor, "... d_sae"]:
        """The features ``f = act(h)``."""
        architecture = self.cfg.architecture
        if architecture == "gated":
            assert gate_pre is not None
            return activations.gate(gate_pre, pre)
        if architecture == "jumprelu":
            return activations.jump_relu(pre, self.threshold)
        if architecture == "topk":
            # The choice is made on decoder-norm-weighted pre-activations when the SAE was
            # trained so; hook_sae_acts_pre still sees the unweighted ones.
            chosen_on = pre
            if self.cfg.rescale_acts_by_decoder_norm:
                chosen_on = pre * self.W_dec.norm(dim=-1)
            return activations.top_k(chosen_on, self.cfg.k)
        return torch.relu(pre)

    def _linear_decode(
        self, feature_acts: Float[Tensor, "... d_sae"]
    ) -> Float[Tensor, "... d_in"]:
        if self.cfg.architecture == "topk" and self.cfg.rescale_acts_by_decoder_norm:
            feature_acts = feature_acts * (1 / self.W_dec.norm(dim=-1))
        return feature_acts @ self.W_dec + self.b_dec

    def _finish(
        self, recons: Float[Tensor, "... d_in"], restore: Restore, d_head: int | None
    ) -> SAEInput:
        out = restore(recons)
        if self.cfg.reshape_activations != "hook_z":
            return out
        if d_head is None:
            raise RuntimeError(
                "a hook_z SAE decodes to [..., n_heads, d_head]: pass d_head, or encode an "
                "input first (its last dimension is d_head)"
            )
        return out.unflatten(-1, (-1, d_head))

    def _flatten_heads(self, x: Tensor) -> Float[Tensor, "... d_in"]:
        if x.ndim < 2 or x.shape[-2] * x.shape[-1] != self.cfg.d_in:
            raise ValueError(
                f"a hook_z SAE reads [..., n_heads, d_head] with n_heads × d_head = d_in "
                f"({self.cfg.d_in}); got shape {list(x.shape)}"
            )
        return x.flatten(-2)

    def extra_repr(self) -> str:
        cfg = self.cfg
        return (
            f"architecture={cfg.architecture!r}, d_in={cfg.d_in}, d_sae={cfg.d_sae}, "
            f"hook_name={cfg.hook_name!r}"
        )


def _dtype_name(dtype: torch.dtype) -> str:
    for name, known in DTYPES.items():
        if known == dtype:
            return name
    raise SAEFormatError(f"dtype {dtype} is not one of {', '.join(DTYPES)}")
