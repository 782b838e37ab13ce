"""Steering as data: what to change at one name, for one request, at which positions.

A :class:`Steer` says, for one name, ``v ↦ (v − (v·û)û) ⊙ gain + scale·add`` at the rows of the
chosen positions (every term optional). The same value works in both of vlens's tiers: on a
compiled engine it becomes rows of per-step buffers that the traced graph reads (no Python runs
in the forward); on an eager engine it becomes an ordinary hook function.

An :class:`SAESteer` edits chosen features of an SAE declared with ``compiled_saes``
(:mod:`vlens.runtime.compiled.saes`): ``f ↦ f·scale + add`` (or ``clamp``), written back into the
activation as ``x + (f' − f)·W_dec``, SAELens's output with its error term.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

Positions = slice | Sequence[int] | None


@dataclass(frozen=True, eq=False)
class Steer:
    """Change ``name``'s value at ``positions`` (absolute sequence positions, prompt and generated
    tokens alike; None: every position) as ``(v − (v·û)û) ⊙ gain + scale·add``.

    - ``add``: a vector of the name's per-position shape (``[d_model]`` for a residual), added
      ``scale`` times;
    - ``ablate``: a direction whose component is removed first (normalised here);
    - ``gain``: an elementwise factor (a vector, or one number for every element).
    """

    name: str
    add: Tensor | None = None
    scale: float = 1.0
    ablate: Tensor | None = None
    gain: Tensor | float | None = None
    positions: Positions = None

    def __post_init__(self) -> None:
        if self.add is None and self.ablate is None and self.gain is None:
            raise ValueError(f"Steer({self.name!r}) changes nothing: give add, ablate or gain")
        check_positions(self.positions, f"Steer({self.name!r})")

    @property
    def target(self) -> str:
        """What the steer changes, as the worker's steering tables key it: the name."""
        return self.name

    def offsets(self, first_position: int, count: int) -> Sequence[int]:
        """Which of ``count`` consecutive positions from ``first_position`` this steer changes,
        as offsets from ``first_position`` (plain Python: it runs for every request each step)."""
        return position_offsets(self.positions, first_position, count)

    def terms(self, width: int) -> tuple[Tensor, Tensor, Tensor]:
        """``(add, gain, ablate)`` as flat fp32 vectors of ``width`` (the name's per-position
        size): zero, one and zero where not given; ``ablate`` of unit length."""
        add = self._flat("add", self.add, width, 0.0) * self.scale
        gain = self._flat("gain", self.gain, width, 1.0)
        ablate = self._flat("ablate", self.ablate, width, 0.0)
        if self.ablate is not None:
            norm = ablate.norm()
            if norm == 0:
                raise ValueError(f"Steer({self.name!r}): the ablate direction is zero")
            ablate = ablate / norm
        return add, gain, ablate

    def check(self, width: int) -> None:
        """Raise what :meth:`terms` would for ``width``, without building the terms (a server
        checks every request's steers)."""
        for field in ("add", "gain", "ablate"):
            value = getattr(self, field)
            if value is not None and (field != "gain" or isinstance(value, Tensor)):
                self._check_size(field, value, width)
        if self.ablate is not None and not bool(self.ablate.detach().any()):
            raise ValueError(f"Steer({self.name!r}): the ablate direction is zero")

    def _flat(self, field: str, value: Tensor | float | None, width: int, neutral: float) -> Tensor:
        if value is None:
            return torch.full((width,), neutral)
        if not isinstance(value, Tensor) and field == "gain":
            return torch.full((width,), float(value))
        self._check_size(field, value, width)
        return value.detach().to("cpu", torch.float32).reshape(-1)

    def _check_size(self, field: str, value: object, width: int) -> None:
        if not isinstance(value, Tensor):
            raise TypeError(f"Steer({self.name!r}).{field} must be a tensor")
        if value.numel() != width:
            raise ValueError(
                f"Steer({self.name!r}).{field} has {value.numel()} elements; {self.name} has "
                f"{width} per position"
            )


def check_positions(positions: Positions, where: str) -> None:
    """Positions count forward from the first prompt token: a generation's length is not known
    in advance."""
    if isinstance(positions, slice):
        parts = (positions.start, positions.stop)
        if any(part is not None and part < 0 for part in parts) or (positions.step or 1) < 1:
            raise ValueError(
                f"{where}: positions {positions} must count forward from the first prompt token "
                f"(a generation's length is not known in advance)"
            )
    elif positions is not None and any(int(p) < 0 for p in positions):
        raise ValueError(
            f"{where}: negative positions are not supported (a generation's length is not "
            f"known in advance); give absolute positions"
        )


def position_offsets(chosen: Positions, first_position: int, count: int) -> Sequence[int]:
    """Which of ``count`` consecutive positions from ``first_position`` are ``chosen``, as
    offsets from ``first_position`` (None: all)."""
    end = first_position + count
    if chosen is None:
        return range(count)
    if isinstance(chosen, slice):
        start, step = chosen.start or 0, chosen.step or 1
        stop = end if chosen.stop is None else min(chosen.stop, end)
        begin = start + max(0, -(-(first_position - start) // step)) * step
        return range(begin - first_position, max(begin, stop) - first_position, step)
    return [p - first_position for p in sorted(set(map(int, chosen))) if first_position <= p < end]


def positions_as_data(positions: Positions) -> list | None:
    """``positions`` as plain data (a request carries it; a fingerprint digests it)."""
    if positions is None:
        return None
    if isinstance(positions, slice):
        return ["slice", positions.start, positions.stop, positions.step]
    return ["list", *(int(p) for p in positions)]


def positions_from_data(value: list | None) -> Positions:
    """The positions :func:`positions_as_data` wrote."""
    if value is None:
        return None
    if value[0] == "slice":
        return slice(*value[1:])
    return list(value[1:])


@dataclass(frozen=True, eq=False)
class SAESteer:
    """Edit ``features`` of the SAE declared as ``sae`` (``compiled_saes={sae: ...}``) at
    ``positions``: ``f' = clamp``, or ``f' = f·scale + add`` (each a number for every feature,
    or one per feature; ``clamp=0.0`` zeroes them). The activation at the SAE's name becomes
    ``x + (f' − f)·W_dec``, the SAE's output with its error term: only the edit changes it, and
    rows no steer edits stay bit for bit."""

    sae: str
    features: Sequence[int]
    clamp: float | Sequence[float] | None = None
    scale: float | Sequence[float] | None = None
    add: float | Sequence[float] | None = None
    positions: Positions = None

    def __post_init__(self) -> None:
        where = f"SAESteer({self.sae!r})"
        features = [int(f) for f in self.features]
        if not features or len(set(features)) != len(features):
            raise ValueError(f"{where}: features must be a non-empty list of distinct indices")
        if self.clamp is None and self.scale is None and self.add is None:
            raise ValueError(f"{where} changes nothing: give clamp, or scale and/or add")
        if self.clamp is not None and (self.scale is not None or self.add is not None):
            raise ValueError(f"{where}: clamp sets the features; it takes no scale or add")
        for field in ("clamp", "scale", "add"):
            self._per_feature(field)
        check_positions(self.positions, where)

    @property
    def target(self) -> str:
        """The worker's steering tables key an SAE's feature edits by ``sae:{name}``."""
        return f"sae:{self.sae}"

    def offsets(self, first_position: int, count: int) -> Sequence[int]:
        """As :meth:`Steer.offsets`."""
        return position_offsets(self.positions, first_position, count)

    def multipliers_and_offsets(self) -> tuple[list[float], list[float]]:
        """``(m, a)`` per feature, with ``f' = f·m + a``."""
        if self.clamp is not None:
            return [0.0] * len(self.features), self._per_feature("clamp")
        scale = self._per_feature("scale") if self.scale is not None else [1.0] * len(self.features)
        add = self._per_feature("add") if self.add is not None else [0.0] * len(self.features)
        return scale, add

    def _per_feature(self, field: str) -> list[float]:
        value = getattr(self, field)
        if value is None:
            return []
        if isinstance(value, (int, float)):
            return [float(value)] * len(self.features)
        values = [float(v) for v in value]
        if len(values) != len(self.features):
            raise ValueError(
                f"SAESteer({self.sae!r}).{field} has {len(values)} values for "
                f"{len(self.features)} features: give one number, or one per feature"
            )
        return values


AnySteer = Steer | SAESteer


def steered(
    value: Float[Tensor, "... width"], add: Tensor, gain: Tensor, ablate: Tensor
) -> Float[Tensor, "... width"]:
    """``(v − (v·û)û) ⊙ gain + add``, row by row (each of ``add``/``gain``/``ablate`` either one
    vector or one row per row of ``value``). Neutral terms (0, 1, 0) leave a row bit for bit."""
    projected = value - (value * ablate).sum(-1, keepdim=True) * ablate
    return projected * gain + add


def as_hook_function(steer: Steer, width: int):
    """``steer`` as an eager hook function (for engines without a compiled graph); the function
    keeps it as its ``steer`` (requests steered alike share the prefix cache,
    :mod:`vlens.engine.prefix_cache`)."""
    add, gain, ablate = steer.terms(width)

    def apply_steer(value: Tensor, hook: Any) -> None:
        rows = value.reshape(value.shape[1], -1)  # [1, pos, ...] -> [pos, width]
        chosen = list(steer.offsets(hook.first_position, hook.length))  # per prompt: one start
        if chosen:
            terms = [t.to(value.device, value.dtype) for t in (add, gain, ablate)]
            rows[chosen] = steered(rows[chosen], *terms)
        return None

    apply_steer.__qualname__ = f"Steer({steer.name!r})"
    apply_steer.steer = steer  # type: ignore[attr-defined]
    return apply_steer


def steers_by_name(steers: Sequence[AnySteer], where: str) -> dict[str, AnySteer]:
    """One steer per name (or SAE) for one request; two on the same are refused (combine
    them)."""
    by_name: dict[str, AnySteer] = {}
    for steer in steers:
        if not isinstance(steer, (Steer, SAESteer)):
            raise TypeError(f"{where}: expected Steer or SAESteer values, got {type(steer).__name__}")
        if steer.target in by_name:
            raise ValueError(
                f"{where}: two steers of {steer.target}; combine them into one (one Steer per "
                f"name, one SAESteer per SAE, with all its features, per request)"
            )
        by_name[steer.target] = steer
    return by_name
