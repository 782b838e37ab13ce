"""The ``vlens`` object of a completion request, read from JSON into steers and names.

Everything here comes from the network: numbers and strings only (vectors as JSON arrays of
numbers, or the name of a vector the server registered at start-up). Nothing is unpickled or run.
A field that is wrong in any way raises :class:`BadVlensField`, which the server answers with an
HTTP 400 carrying its message.
"""

from __future__ import annotations

import array
import base64
import binascii
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from vlens.runtime.vocabulary.steering import AnySteer, SAESteer, Steer

#: The keys of the ``vlens`` object and of one of its steering entries.
REQUEST_KEYS = frozenset({"steering", "capture"})
STEER_KEYS = frozenset({"name", "add", "scale", "ablate", "gain", "positions"})
SAE_STEER_KEYS = frozenset({"sae", "features", "clamp", "scale", "add", "positions"})


FLOAT32_MAX = torch.finfo(torch.float32).max

#: The largest magnitude a steer may give an activation, whatever the dtype: beyond it the
#: sum of squares in the next norm overflows float32 (2**64 per element, times widths of up to
#: 2**20) and the request would finish with NaN logits, that is, garbage tokens.
ACTIVATION_BOUND = 2.0**32


class BadVlensField(ValueError):
    """A request's ``vlens`` object cannot be served as given (answered with HTTP 400)."""


@dataclass(frozen=True)
class VlensFields:
    """What one request asks of vlens: steers (names as the client wrote them) and names to
    capture."""

    steering: tuple[AnySteer, ...] = ()
    capture: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.steering and not self.capture


def read_fields(value: Any, vectors: Mapping[str, Tensor]) -> VlensFields:
    """The ``vlens`` object of a request; ``vectors``: the server's named vectors."""
    if value is None:
        return VlensFields()
    if not isinstance(value, dict):
        raise BadVlensField(f"vlens must be an object, got {_json_type(value)}")
    unknown = sorted(set(value) - REQUEST_KEYS)
    if unknown:
        raise BadVlensField(f"vlens: unknown field(s) {unknown}; known: {sorted(REQUEST_KEYS)}")
    steering = value.get("steering", [])
    if not isinstance(steering, list):
        raise BadVlensField(f"vlens.steering must be a list, got {_json_type(steering)}")
    capture = value.get("capture", [])
    if not isinstance(capture, list) or not all(isinstance(name, str) for name in capture):
        raise BadVlensField("vlens.capture must be a list of hook names (strings)")
    steers = tuple(
        _steer(entry, f"vlens.steering[{index}]", vectors) for index, entry in enumerate(steering)
    )
    return VlensFields(steers, tuple(capture))


def _steer(entry: Any, where: str, vectors: Mapping[str, Tensor]) -> AnySteer:
    if not isinstance(entry, dict):
        raise BadVlensField(f"{where} must be an object, got {_json_type(entry)}")
    if "sae" in entry:
        return _sae_steer(entry, where)
    unknown = sorted(set(entry) - STEER_KEYS)
    if unknown:
        raise BadVlensField(f"{where}: unknown field(s) {unknown}; known: {sorted(STEER_KEYS)}")
    name = entry.get("name")
    if not isinstance(name, str):
        raise BadVlensField(f"{where}.name must be a hook name (a string)")
    scale = entry.get("scale", 1.0)
    if not _is_number(scale):
        raise BadVlensField(f"{where}.scale must be a finite number")
    gain = entry.get("gain")
    try:
        return Steer(
            name,
            add=_vector(entry.get("add"), f"{where}.add", vectors),
            scale=float(scale),
            ablate=_vector(entry.get("ablate"), f"{where}.ablate", vectors),
            gain=float(gain) if _is_number(gain) else _vector(gain, f"{where}.gain", vectors),
            positions=_positions(entry.get("positions"), f"{where}.positions"),
        )
    except (TypeError, ValueError) as error:
        if isinstance(error, BadVlensField):
            raise
        raise BadVlensField(f"{where}: {error}") from None


def _sae_steer(entry: dict, where: str) -> SAESteer:
    """``{"sae": NAME, "features": [...], "clamp" | "scale" and/or "add": number or [...],
    "positions": [start, stop]}``."""
    unknown = sorted(set(entry) - SAE_STEER_KEYS)
    if unknown:
        raise BadVlensField(f"{where}: unknown field(s) {unknown}; an SAE's steer knows "
                            f"{sorted(SAE_STEER_KEYS)}")
    name = entry["sae"]
    if not isinstance(name, str):
        raise BadVlensField(f"{where}.sae must be the name of an SAE the server has (--sae)")
    features = entry.get("features")
    if not isinstance(features, list) or not all(
        isinstance(f, int) and not isinstance(f, bool) for f in features
    ):
        raise BadVlensField(f"{where}.features must be an array of feature indices (integers)")
    values = {}
    for key in ("clamp", "scale", "add"):
        value = entry.get(key)
        if value is None:
            continue
        if not (_is_number(value) or (isinstance(value, list) and all(map(_is_number, value)))):
            raise BadVlensField(f"{where}.{key} must be a finite number or an array of them")
        values[key] = value
    try:
        return SAESteer(name, features, **values,
                        positions=_positions(entry.get("positions"), f"{where}.positions"))
    except ValueError as error:
        if isinstance(error, BadVlensField):
            raise
        raise BadVlensField(f"{where}: {error}") from None


def _vector(value: Any, where: str, vectors: Mapping[str, Tensor]) -> Tensor | None:
    """A JSON array of finite numbers, ``{"base64": ...}`` (little-endian float32, as OpenAI's
    embeddings API encodes vectors), or the name of a registered vector."""
    if value is None:
        return None
    if isinstance(value, str):
        if value not in vectors:
            known = ", ".join(sorted(vectors)) or "none (start the server with --vectors FILE)"
            raise BadVlensField(f"{where}: no vector named {value!r}; the server has: {known}")
        return vectors[value]
    if isinstance(value, dict):
        vector = _base64_vector(value, where)
    else:
        vector = _array_vector(value, where)
    if not bool(torch.isfinite(vector).all()):
        raise BadVlensField(f"{where} holds a non-finite value (NaN or infinity)")
    largest = _largest(vector)
    if largest > FLOAT32_MAX:  # the model's own dtype is checked once the steer is whole
        raise BadVlensField(f"{where} holds {largest:.3g}, beyond float32 (largest magnitude "
                            f"{FLOAT32_MAX:.3g}), the type vectors travel in")
    return vector.to(torch.float32)


def check_range(steering: tuple[AnySteer, ...], dtype: torch.dtype) -> None:
    """Refuse a steer whose values, as applied (``add`` times ``scale``, ``gain``, an SAE
    steer's numbers), overflow the model's ``dtype`` or :data:`ACTIVATION_BOUND`: vLLM would
    turn them into infinities and the request into garbage tokens."""
    limit = min(torch.finfo(dtype).max, ACTIVATION_BOUND)
    for index, steer in enumerate(steering):
        where = f"vlens.steering[{index}]"
        if isinstance(steer, Steer):
            values = {
                "add × scale": _largest(steer.add) * abs(steer.scale),
                "gain": _largest(steer.gain),
                "ablate": _largest(steer.ablate),
            }
        else:
            values = {key: _largest(getattr(steer, key)) for key in ("clamp", "scale", "add")}
        for field, largest in values.items():
            if not largest <= limit:  # also NaN: 0 × inf
                raise BadVlensField(
                    f"{where}.{field} reaches {largest:.3g}, beyond what the model computes "
                    f"in {dtype} without overflowing (magnitudes up to {limit:.3g}); steer "
                    f"with smaller values"
                )


def _largest(value: Tensor | float | list[float] | None) -> float:
    """The largest magnitude in a steer's value, in float64 (0 when absent)."""
    if value is None:
        return 0.0
    if isinstance(value, Tensor):
        return float(value.detach().to(torch.float64).abs().max()) if value.numel() else 0.0
    if isinstance(value, (list, tuple)):
        return max((abs(float(v)) for v in value), default=0.0)
    return abs(float(value))


def _array_vector(value: Any, where: str) -> Tensor:
    # Checked and converted as a whole: a vector is a model's width (thousands of numbers), and
    # a loop over them in Python costs milliseconds per request in the server's one thread.
    if not isinstance(value, list) or not value or not set(map(type, value)) <= {float, int}:
        raise BadVlensField(
            f"{where} must be a non-empty array of numbers, {{\"base64\": ...}} or a registered "
            f"vector's name"
        )
    try:
        return torch.frombuffer(array.array("d", value), dtype=torch.float64)
    except OverflowError:
        raise BadVlensField(f"{where} holds a number too large for a float") from None


def _base64_vector(value: dict, where: str) -> Tensor:
    encoded = value.get("base64")
    if set(value) != {"base64"} or not isinstance(encoded, str):
        raise BadVlensField(f"{where}: a vector object is {{\"base64\": \"...\"}} (float32, "
                            f"little-endian)")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise BadVlensField(f"{where}.base64 is not base64") from None
    if not raw or len(raw) % 4:
        raise BadVlensField(f"{where}.base64 holds {len(raw)} bytes, not a whole number of "
                            f"float32 values")
    return torch.frombuffer(bytearray(raw), dtype=torch.float32)


def _positions(value: Any, where: str) -> slice | None:
    """``[start, stop]`` (stop may be null: to the end), as absolute sequence positions."""
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not isinstance(value[0], int)
        or not (value[1] is None or isinstance(value[1], int))
        or isinstance(value[0], bool)
        or isinstance(value[1], bool)
    ):
        raise BadVlensField(f"{where} must be [start, stop] (integers; stop may be null)")
    return slice(value[0], value[1])


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return _is_real(value) and math.isfinite(value)


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return names.get(type(value), "a number")
