"""What a store is asked for: the names it holds (hook names and glob patterns, resolved by
vlens's one resolver, :func:`vlens.names.resolve.select`) and the prompts of its prompt file."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from vlens.names.mapping import Spec
from vlens.names.resolve import select
from vlens.store.manifest import StoreError

#: A prompt: text (tokenized by the model's tokenizer) or token ids.
Prompt = str | list[int]


# ---- which names ---------------------------------------------------------------------------------


def stored_names(patterns: Sequence[str], specs: Mapping[str, Spec]) -> list[str]:
    """The canonical names that hook names or glob patterns (``blocks.*.hook_resid_post``) pick,
    in forward order. Only token-major names (``[pos, ...]``) can be stored as rows."""
    if not patterns:
        raise StoreError("give at least one hook name or pattern")
    names = select(list(patterns), list(specs), listing="`vlens names MODEL` lists all")
    for name in names:
        _require_token_major(name, specs[name].shape)
    return names


def _require_token_major(name: str, shape: str) -> None:
    axes = shape.split()
    if axes[0] != "pos" or any(axis.endswith("pos") for axis in axes[1:]):
        raise StoreError(
            f"{name} is [batch {shape}], not one row per token ([batch pos ...]): only token-major "
            f"names can be stored for now (attention scores and patterns cannot)."
        )


# ---- prompt files --------------------------------------------------------------------------------


def read_prompts(path: Path) -> Iterator[Prompt]:
    """The prompts of a file, lazily: in a ``.jsonl`` file one JSON object per line with a "text"
    (string) or a "tokens" (token ids) field; in any other file one text per line. Blank lines
    are skipped."""
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                yield prompt_of_line(line, path, number)


def prompt_of_line(line: str, path: Path, number: int) -> Prompt:
    """The prompt on line ``number`` (not blank) of the prompt file at ``path``."""
    if path.suffix == ".jsonl":
        return _json_prompt(line, f"{path}:{number}")
    return line.rstrip("\r\n")


def count_prompts(path: Path) -> int:
    """How many prompts :func:`read_prompts` yields, without parsing them."""
    with path.open(encoding="utf-8") as lines:
        return sum(1 for line in lines if line.strip())


def _json_prompt(line: str, where: str) -> Prompt:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise StoreError(f"{where}: not JSON ({error})") from error
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return record["text"]
    tokens = record.get("tokens") if isinstance(record, dict) else None
    if isinstance(tokens, list) and tokens and all(isinstance(t, int) for t in tokens):
        return tokens
    raise StoreError(f'{where}: expected an object with "text" (a string) or "tokens" (token ids)')
