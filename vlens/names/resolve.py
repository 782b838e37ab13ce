"""Turning what a user types into a canonical TransformerLens hook name.

Accepted: canonical names (``blocks.3.hook_resid_post``), TransformerLens 4 bridge names
(``blocks.3.hook_out``), glob patterns where many names are wanted (``blocks.*.hook_resid_post``)
and, in cache lookups, TransformerLens's short forms (``cache["resid_post", 3]``, resolved by
TransformerLens's own ``get_act_name``). Every part of vlens that reads names a user typed resolves
them here (:func:`canonical`, :func:`select`), with one "did you mean" rule (:func:`nearest`).
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Callable, Collection, Iterable, Sequence

from vlens.names.tl_versions import HAS_BRIDGE, get_act_name


def _synonyms() -> list[tuple[str, str]]:
    """Pairs of spellings of one hook (``{layer}`` for a block's index): TransformerLens 4's
    ``TransformerBridge`` declares each component's HookedTransformer names beside its own
    (``attn.hook_z`` = ``attn.o.hook_in``); TransformerLens 3 has no bridge, and its users
    none of its names."""
    extra = [
        ("blocks.{layer}.ln1.hook_in", "blocks.{layer}.hook_resid_pre"),
        ("hook_logits", "unembed.hook_out"),
        ("logits", "unembed.hook_out"),
    ]
    if not HAS_BRIDGE:
        return extra
    from transformer_lens.model_bridge.bridge_core import BridgeCore
    from transformer_lens.model_bridge.generalized_components.attention import AttentionBridge
    from transformer_lens.model_bridge.generalized_components.block import BlockBridge
    from transformer_lens.model_bridge.generalized_components.gated_mlp import GatedMLPBridge
    from transformer_lens.model_bridge.generalized_components.mlp import MLPBridge

    by_prefix = [
        ("", BridgeCore.hook_aliases),
        ("blocks.{layer}.", BlockBridge.hook_aliases),
        ("blocks.{layer}.attn.", AttentionBridge.hook_aliases),
        ("blocks.{layer}.mlp.", GatedMLPBridge.hook_aliases),  # first: "in" is "up" when gated
        ("blocks.{layer}.mlp.", MLPBridge.hook_aliases),
    ]
    pairs = [
        (prefix + name, prefix + other)
        for prefix, table in by_prefix
        for name, others in table.items()
        for other in ([others] if isinstance(others, str) else others)
    ]
    return pairs + extra


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile(re.escape(template).replace(re.escape("{layer}"), r"(?P<layer>\d+)"))


#: Other spellings → the one a mapping uses: each synonym pair read both ways (whichever side a
#: model has is its canonical name).
ALIASES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (_pattern(source), target.replace("{layer}", r"\g<layer>"))
    for left, right in _synonyms()
    for source, target in ((left, right), (right, left))
)

NamesFilter = None | str | Sequence[str] | Callable[[str], bool]

#: A block's index inside a name, as a layer template writes it (``blocks.*.hook_z``).
_LAYER = re.compile(r"\.\d+\.")


def is_pattern(name: str) -> bool:
    """Whether ``name`` is a glob pattern (``blocks.*.hook_resid_post``) rather than a name."""
    return any(character in name for character in "*?[")


def nearest(typed: str, known: Iterable[str]) -> list[str]:
    """The names nearest to what was typed, for a "did you mean". A pattern is compared with
    the names' layer templates (``blocks.*.hook_z``), so that one suggestion covers every
    layer."""
    candidates = sorted({_LAYER.sub(".*.", name) for name in known}) if is_pattern(typed) else known
    return difflib.get_close_matches(typed, list(candidates), n=5, cutoff=0.6)


class UnknownHookName(KeyError):
    """A hook name (or pattern) this model does not have; the message lists the nearest ones it
    does."""

    def __init__(
        self,
        name: str,
        known: Collection[str],
        what: str = "this model",
        listing: str = "model.hook_names lists all",
        noun: str = "a hook name",
    ) -> None:
        near = nearest(name, known)
        hint = f" Did you mean: {', '.join(near)}?" if near else ""
        if is_pattern(name):
            problem = f"no {noun.removeprefix('a ')} of {what} matches {name!r}."
        else:
            problem = f"{name!r} is not {noun} of {what}."
        super().__init__(f"{problem}{hint} ({listing}.)")

    def __str__(self) -> str:
        return str(self.args[0])


#: An architecture's account of names it can never offer (a routed expert of a fused MoE
#: kernel...): the reason, or None for a name it has nothing to say about.
Explain = Callable[[str], "str | None"]


class UnavailableHookName(UnknownHookName):
    """A name that looks right but this architecture cannot give, with the reason."""

    def __init__(self, reason: str) -> None:
        KeyError.__init__(self, reason)


def canonical(
    name: str,
    known: Collection[str],
    what: str = "this model",
    explain: Explain | None = None,
    listing: str = "model.hook_names lists all",
) -> str:
    """The canonical spelling of ``name``, or :class:`UnknownHookName` (with the architecture's
    reason when ``explain`` has one)."""
    if name in known:
        return name
    for pattern, target in ALIASES:
        if pattern.fullmatch(name):
            aliased = pattern.sub(target, name)
            if aliased in known:
                return aliased
    reason = explain(name) if explain is not None else None
    if reason is not None:
        raise UnavailableHookName(reason)
    raise UnknownHookName(name, known, what, listing)


def short_form(key: tuple) -> str:
    """``("resid_post", 3)`` → ``blocks.3.hook_resid_post``, as TransformerLens spells it."""
    return get_act_name(*key)


def select(
    names_filter: NamesFilter,
    known: Sequence[str],
    explain: Explain | None = None,
    listing: str = "model.hook_names lists all",
    label: str = "names_filter",
) -> list[str]:
    """The canonical names a TransformerLens ``names_filter`` picks among ``known``, in
    ``known``'s order: None picks all; a function, the names it accepts (at least one); a name
    or a list, each name in any spelling :func:`canonical` takes, or a glob pattern
    (``blocks.*.hook_resid_post``) matching at least one name. The one resolver of what a user
    types for many names: calls, hooks, compiled names, stores, served captures."""
    if names_filter is None:
        return list(known)
    if callable(names_filter):
        chosen = [name for name in known if names_filter(name)]
        if not chosen:
            raise ValueError(f"{label} accepted none of this model's hook names")
        return chosen
    picked: set[str] = set()
    for name in [names_filter] if isinstance(names_filter, str) else names_filter:
        if not is_pattern(name):
            picked.add(canonical(name, known, explain=explain, listing=listing))
            continue
        matched = fnmatch.filter(known, name)
        if not matched:
            raise UnknownHookName(name, known, listing=listing)
        picked.update(matched)
    return [name for name in known if name in picked]
