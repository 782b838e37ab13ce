"""An activation store's ``manifest.json`` and its shards' checks.

The manifest records each shard's size in bytes and its sha256. A shard fails its check when it is
missing, has another size or another sha256. Manifests written before checksums were recorded
name shards without them: those are checked for readability instead (the safetensors header covers
the whole file, and holds the manifest's names with its number of rows).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

FORMAT = "vlens-activations/1"
MANIFEST = "manifest.json"
SHARD_GLOB = "shard-*.safetensors"
TEMP_SUFFIX = ".tmp"
MANIFEST_TEMP = MANIFEST + TEMP_SUFFIX

#: The manifest's fields and their types; each shard's, each prompt's, and each name's.
FIELDS = {"format": str, "model": str, "dtype": str, "max_new_tokens": int, "names": dict,
          "shards": list, "prompts": list}
SHARD_FIELDS = {"file": str, "rows": int}
PROMPT_FIELDS = {"shard": int, "start": int, "stop": int, "prompt_length": int, "tokens": list}
NAME_FIELDS = {"shape": list, "dtype": str}
CHECKSUM_FIELDS = {"bytes": int, "sha256": str}  # absent from shards of older manifests
CHUNK = 1 << 20


class StoreError(ValueError):
    """A request the store cannot honour: a bad name, prompt file or folder, or a store made
    differently or damaged."""


# ---- reading -------------------------------------------------------------------------------------


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of ``folder``, or None where there is none yet. Refuses one that is not
    whole."""
    path = folder / MANIFEST
    if not path.exists():
        return None
    start_again = f"move {folder} aside and write the store again to an empty folder"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise StoreError(f"{path} is not valid JSON ({error}): {start_again}") from None
    except OSError as error:
        raise StoreError(f"cannot read {path} ({error.strerror}): {start_again}") from None
    problem = manifest_problem(manifest)
    if problem:
        raise StoreError(f"{path} is incomplete or damaged: {problem}; {start_again}")
    return manifest


def manifest_problem(manifest: object) -> str | None:
    """What makes ``manifest`` unusable (absent or mistyped fields, another format, prompts that
    do not fill their shards), or None."""
    if not isinstance(manifest, dict):
        return "it is not a JSON object"
    problem = _fields_problem(manifest, FIELDS, "the manifest")
    if problem:
        return problem
    if manifest["format"] != FORMAT:
        return f"its format is {manifest['format']!r}, not {FORMAT!r}"
    names, shards, prompts = manifest["names"], manifest["shards"], manifest["prompts"]
    records = [
        *(_fields_problem(info, NAME_FIELDS, f"name {name}") for name, info in names.items()),
        *(_shard_record_problem(shard, f"shard {i}") for i, shard in enumerate(shards)),
        *(_fields_problem(p, PROMPT_FIELDS, f"prompt {i}") for i, p in enumerate(prompts)),
    ]
    return next((problem for problem in records if problem), None) or _rows_problem(manifest)


def _fields_problem(record: object, fields: dict[str, type], what: str) -> str | None:
    if not isinstance(record, dict):
        return f"{what} is not a JSON object"
    missing = [key for key in fields if key not in record]
    if missing:
        return f"{what} lacks {', '.join(missing)}"
    wrong = [key for key, kind in fields.items() if not isinstance(record[key], kind)]
    return f"{what} has a mistyped {', '.join(wrong)}" if wrong else None


def _shard_record_problem(shard: object, what: str) -> str | None:
    problem = _fields_problem(shard, SHARD_FIELDS, what)
    if problem or not CHECKSUM_FIELDS.keys() & shard.keys():
        return problem
    return _fields_problem(shard, CHECKSUM_FIELDS, what)


def _rows_problem(manifest: dict[str, Any]) -> str | None:
    """Each shard's prompts fill its rows back to back from row 0, one token id per row."""
    shards = manifest["shards"]
    filled = [0] * len(shards)
    for index, prompt in enumerate(manifest["prompts"]):
        shard, start, stop = prompt["shard"], prompt["start"], prompt["stop"]
        follows = 0 <= shard < len(shards) and start == filled[shard]
        if not (follows and start < stop == start + len(prompt["tokens"])):
            return f"prompt {index} does not follow the previous rows of shard {shard}"
        filled[shard] = stop
    unfilled = [i for i, shard in enumerate(shards) if not 0 < filled[i] == shard["rows"]]
    return f"the prompts do not fill shard {unfilled[0]}'s rows" if unfilled else None


# ---- writing -------------------------------------------------------------------------------------


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """``write(temp)``, then make ``temp`` durable and rename it to ``path``: readers see the old
    file or the whole new one, never part of it."""
    temp = path.with_name(path.name + TEMP_SUFFIX)
    write(temp)
    temp.chmod(0o644)  # safetensors creates files only their owner can read; stores are shared
    fsync(temp)
    os.replace(temp, path)
    fsync(path.parent)


def fsync(path: Path) -> None:
    """Flush a file's or a folder's entries to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    text = _manifest_text(manifest)
    write_atomically(folder / MANIFEST, lambda temp: temp.write_text(text, encoding="utf-8"))


def _manifest_text(manifest: dict[str, Any]) -> str:
    """JSON with one line per field, and one line per record of a list or of a dict of records
    (prompts, shards, names): readable, and a prompt's tokens stay on its line."""
    fields = []
    for key, value in manifest.items():
        if isinstance(value, list):
            records, brackets = [json.dumps(item) for item in value], "[]"
        elif isinstance(value, dict) and all(isinstance(item, dict) for item in value.values()):
            records = [f"{json.dumps(name)}: {json.dumps(item)}" for name, item in value.items()]
            brackets = "{}"
        else:
            fields.append(f"  {json.dumps(key)}: {json.dumps(value)}")
            continue
        body = "".join(f"\n    {record}," for record in records).rstrip(",")
        fields.append(f"  {json.dumps(key)}: {brackets[0]}{body}\n  {brackets[1]}")
    return "{\n" + ",\n".join(fields) + "\n}\n"


def checksums(path: Path) -> dict[str, Any]:
    """The size and sha256 of a file, as a shard record holds them."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(CHUNK):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


# ---- checking shards -----------------------------------------------------------------------------


def shard_problems(
    folder: Path, manifest: dict[str, Any], progress: Callable[[Iterable], Iterable] = iter
) -> dict[int, str]:
    """Each shard that fails its check, by index, with what is wrong with it."""
    names = list(manifest["names"])
    problems = {}
    for index, shard in progress(list(enumerate(manifest["shards"]))):
        problem = shard_problem(folder / shard["file"], shard, names)
        if problem:
            problems[index] = problem
    return problems


def shard_problem(path: Path, shard: dict[str, Any], names: list[str]) -> str | None:
    """What is wrong with the shard at ``path`` (recorded in the manifest as ``shard``), or
    None."""
    if not path.is_file():
        return "missing"
    if "sha256" not in shard:
        return _unreadable(path, shard["rows"], names)
    size = path.stat().st_size
    if size != shard["bytes"]:
        return f"{size} bytes, the manifest records {shard['bytes']}"
    if checksums(path)["sha256"] != shard["sha256"]:
        return "its sha256 differs from the manifest's"
    return None


def _unreadable(path: Path, rows: int, names: list[str]) -> str | None:
    """Why a shard without recorded checksums cannot be what the manifest says, or None."""
    try:
        with safe_open(path, "pt") as shard:
            shapes = {key: shard.get_slice(key).get_shape() for key in shard.keys()}
    except SafetensorError as error:
        return f"unreadable ({error})"
    if sorted(shapes) != sorted(names):
        return f"holds {sorted(shapes)}, not the manifest's names"
    wrong = [name for name, shape in shapes.items() if not shape or shape[0] != rows]
    return f"{wrong[0]} does not have the manifest's {rows} rows" if wrong else None


# ---- the report of `vlens cache --verify` --------------------------------------------------------


def verify_report(folder: Path) -> tuple[list[str], bool]:
    """Lines saying what ``folder``'s store holds and which shards fail their check; and whether
    none does."""
    if not folder.is_dir():
        raise StoreError(f"{folder} is not a folder: give --verify a store's folder")
    manifest = read_manifest(folder)
    if manifest is None:
        raise StoreError(f"{folder} has no {MANIFEST}: it is not a vlens store, or no shard was "
                         f"written yet")
    shards = manifest["shards"]
    problems = shard_problems(folder, manifest)
    rows = sum(shard["rows"] for shard in shards)
    lines = [f"{folder}: {len(shards)} shards, {rows} rows, {len(manifest['prompts'])} prompts"]
    lines += [f"{shards[index]['file']}: {problem}" for index, problem in problems.items()]
    unchecked = sum("sha256" not in shard for shard in shards)
    if unchecked:
        lines.append(f"{unchecked} shards have no recorded checksums (an older manifest): "
                     f"checked for readability only; a resume records them")
    if problems:
        lines.append(f"{len(problems)} of {len(shards)} shards fail their check: run the same "
                     f"`vlens cache` command again to rewrite them")
    else:
        lines.append("every shard passes its check")
    return lines, not problems
