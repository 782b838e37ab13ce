"""Steering as data: what to change at one name, for one request, at which positions.

A :class:`Steer` says, for one name, ``v ↦ (v − (v·û)û) ⊙ gain + scale·add`` at the rows of the
chosen positions (every term optional). The same value works in both of vlens's tiers: on a
compiled engine it becomes rows of per-step buffers that the traced graph reads (no Python runs
in the forward); on an eager engine it becomes an ordinary hook function.
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
        if isinstance(self.positions, slice):
            parts = (self.positions.start, self.positions.stop)
            if any(part is not None and part < 0 for part in parts) or (self.positions.step or 1) < 1:
                raise ValueError(
                    f"Steer({self.name!r}): positions {self.positions} must count forward from "
                    f"the first prompt token (a generation's length is not known in advance)"
                )
        elif self.positions is not None and any(int(p) < 0 for p in self.positions):
            raise ValueError(
                f"Steer({self.name!r}): negative positions are not supported (a generation's "
                f"length is not known in advance); give absolute positions"
            )

    def offsets(self, first_position: int, count: int) -> Sequence[int]:
        """Which of ``count`` consecutive positions from ``first_position`` this steer changes,
        as offsets from ``first_position`` (plain Python: it runs for every request each step)."""
        chosen, end = self.positions, first_position + count
        if chosen is None:
            return range(count)
        if isinstance(chosen, slice):
            start, step = chosen.start or 0, chosen.step or 1
            stop = end if chosen.stop is None else min(chosen.stop, end)
            begin = start + max(0, -(-(first_position - start) // step)) * step
            return range(begin - first_position, max(begin, stop) - first_position, step)
        return [p - first_position for p in sorted(set(map(int, chosen))) if first_position <= p < end]

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

    def _flat(self, field: str, value: Tensor | float | None, width: int, neutral: float) -> Tensor:
        if value is None:
            return torch.full((width,), neutral)
        if not isinstance(value, Tensor):
            if field != "gain":
                raise TypeError(f"Steer({self.name!r}).{field} must be a tensor")
            return torch.full((width,), float(value))
        flat = value.detach().to("cpu", torch.float32).reshape(-1)
        if flat.numel() != width:
            raise ValueError(
                f"Steer({self.name!r}).{field} has {flat.numel()} elements; {self.name} has "
                f"{width} per position"
            )
        return flat


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


def steers_by_name(steers: Sequence[Steer], where: str) -> dict[str, Steer]:
    """One steer per name for one request; two on the same name are refused (combine them)."""
    by_name: dict[str, Steer] = {}
    for steer in steers:
        if not isinstance(steer, Steer):
            raise TypeError(f"{where}: expected Steer values, got {type(steer).__name__}")
        if steer.name in by_name:
            raise ValueError(
                f"{where}: two Steer values for {steer.name}; combine them into one (one add "
                f"vector, one ablate direction, one gain per name and request)"
            )
        by_name[steer.name] = steer
    return by_name
