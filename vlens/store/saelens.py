"""A vlens store as SAELens's cached-activations dataset, for training SAEs with SAELens.

SAELens trains from a HuggingFace ``datasets.Dataset`` saved with ``save_to_disk`` (what its
``CacheActivationsRunner`` writes and ``ActivationsStore(cached_activations_path=...)`` reads):
one row per context, a column per hook name holding ``Array2D(shape=(context_size, d_in))``
and a ``token_ids`` column of ``context_size`` int32 ids. SAELens's contexts all have
``context_size`` tokens, so each stored prompt becomes one context: all prompts must have the
same number of rows, or ``context_size`` cuts each to its first rows (as SAELens cuts the rows
of a pretokenized dataset); a shorter prompt is refused.

The rows stream from the store's shards, one context at a time, into ``datasets``'s generator
builder (its cache lies beside the dataset and is deleted afterwards), so memory holds a few
contexts. The dataset is written under a temporary name and renamed once whole, with a record of
the store it came from (the sha256 of its ``manifest.json``) and its settings: a later call for
the same store and settings finds it complete and keeps it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from vlens.store.blocks import INDEX, block_manifest, index_blocks, read_index
from vlens.store.manifest import (
    MANIFEST,
    StoreError,
    fsync,
    read_manifest,
    shard_problems,
    write_atomically,
)

#: Where :func:`write_saelens_dataset` puts the dataset inside a store folder by default.
DATASET_FOLDER = "saelens"
#: The record, inside the dataset folder, of the store and settings it was written from.
RECORD = "vlens-export.json"
RECORD_FORMAT = "vlens-saelens/1"
#: The Arrow dtype of each store dtype: Arrow has no bfloat16, and float32 holds it exactly.
ARROW_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "float32"}
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16}
#: Rows ``datasets`` gathers before writing them: about this many bytes at a time.
WRITER_BYTES = 64 << 20


@dataclass(frozen=True)
class SaelensDataset:
    """What :func:`write_saelens_dataset` wrote (or found already written: ``written`` False)."""

    folder: Path
    context_size: int
    contexts: int
    d_in: dict[str, int]
    dtype: str
    rows_left_out: int  # rows of prompts longer than ``context_size``, past their first ones
    written: bool


def write_saelens_dataset(
    store_folder: Path | str,
    out_folder: Path | str | None = None,
    *,
    context_size: int | None = None,
    names: Sequence[str] | None = None,
    check_shards: bool = True,
    progress: bool = False,
) -> SaelensDataset:
    """Write the store in ``store_folder`` as SAELens's cached-activations dataset in
    ``out_folder`` (default ``STORE/saelens``), one context per stored prompt.

    ``names``: the hook names to write, a column each (default: all of the store's). Only
    floating names with a width per token can be: ``[pos, d]`` as it is, ``[pos, head, d_head]``
    flattened to ``head * d_head`` as SAELens reads ``hook_z`` (``reshape_activations="hook_z"``).
    ``context_size``: the tokens per context; None takes every prompt's length, which must be the
    same for all; N cuts every prompt to its first N rows and refuses a shorter one.
    ``check_shards``: check every shard against the manifest's size and sha256 first (the
    ``vlens cache`` command skips it: it has just checked or written them).

    A dataset already written there from the same store with the same settings is kept.
    """
    datasets = require_datasets()
    store_folder = Path(store_folder)
    out = Path(out_folder) if out_folder is not None else store_folder / DATASET_FOLDER
    parts = _parts(store_folder)
    manifest = parts[0][1]  # every block of a blocked store has the same names and dtype
    prompts = [prompt for _, part in parts for prompt in part["prompts"]]
    names = list(manifest["names"]) if names is None else list(names)
    d_in = exportable_widths(manifest, names)
    dtype = ARROW_DTYPES[manifest["dtype"]]
    size, left_out = _context_size(prompts, context_size)
    manifests = b"".join((folder / MANIFEST).read_bytes() for folder, _ in parts)
    record = {
        "format": RECORD_FORMAT,
        "store_manifest_sha256": hashlib.sha256(manifests).hexdigest(),
        "context_size": size,
        "contexts": len(prompts),
        "d_in": d_in,
        "dtype": dtype,
    }
    result = SaelensDataset(out, size, record["contexts"], d_in, dtype, left_out, written=True)
    features = saelens_features(d_in, size, dtype)
    if _already_written(out, record, features):
        return dataclasses.replace(result, written=False)
    _require_replaceable(out)
    for folder, part in parts if check_shards else []:
        problems = shard_problems(folder, part)
        if problems:
            index, problem = next(iter(problems.items()))
            raise StoreError(
                f"{len(problems)} shards of {folder} fail their check "
                f"({part['shards'][index]['file']}: {problem}): run the same `vlens cache` "
                f"command again to rewrite them, then write the dataset again"
            )

    temp, cache = out.with_name(out.name + ".tmp"), out.with_name(out.name + ".cache")
    for leftover in (temp, cache):  # an interrupted export's
        shutil.rmtree(leftover, ignore_errors=True)
    bytes_per_context = size * (sum(d_in.values()) * np.dtype(dtype).itemsize + 4)
    try:
        with _datasets_progress(progress):
            dataset = datasets.Dataset.from_generator(
                # Bound here, not through gen_kwargs: datasets splits list arguments into shards.
                functools.partial(_contexts, parts, names, size, dtype),
                features=features,
                cache_dir=str(cache),
                fingerprint=hashlib.sha256(json.dumps(record).encode()).hexdigest()[:32],
                writer_batch_size=max(1, WRITER_BYTES // bytes_per_context),
            )
            dataset.save_to_disk(str(temp))
        del dataset
        for path in temp.iterdir():
            fsync(path)
        text = json.dumps(record, indent=2) + "\n"
        write_atomically(temp / RECORD, lambda path: path.write_text(text, encoding="utf-8"))
        if out.exists():
            shutil.rmtree(out)
        os.replace(temp, out)
        fsync(out.parent)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return result


def require_datasets() -> Any:
    """HuggingFace ``datasets``, which only the SAELens export needs."""
    try:
        import datasets
    except ModuleNotFoundError:
        raise StoreError(
            "writing SAELens's dataset needs HuggingFace datasets: pip install datasets"
        ) from None
    return datasets


def saelens_features(d_in: dict[str, int], context_size: int, dtype: str) -> Any:
    """The dataset's features, as SAELens's caching runner declares them: an ``Array2D`` per
    hook name and ``token_ids``, ``context_size`` int32 ids."""
    from datasets import Array2D, Features, Sequence, Value

    columns: dict[str, Any] = {
        name: Array2D(shape=(context_size, width), dtype=dtype) for name, width in d_in.items()
    }
    columns["token_ids"] = Sequence(Value("int32"), length=context_size)
    return Features(columns)


def exportable_widths(manifest: dict[str, Any], names: Sequence[str]) -> dict[str, int]:
    """Each name's ``d_in``: its per-token width, heads flattened. Refuses names the store lacks,
    integer names (expert indices) and names with more than two axes per token."""
    if not names:
        raise StoreError("give at least one hook name to write")
    stored = manifest["names"]
    missing = [name for name in names if name not in stored]
    if missing:
        raise StoreError(
            f"the store does not hold {', '.join(missing)}; it holds {', '.join(stored)}"
        )
    widths = {}
    for name in names:
        shape, dtype = stored[name]["shape"], stored[name]["dtype"]
        if dtype not in ARROW_DTYPES:
            raise StoreError(
                f"{name} holds {dtype} values: an SAE trains on floating activations; leave it "
                f"out of the SAELens dataset (write the others with names=[...], or store it "
                f"apart)"
            )
        problem = per_token_width_problem(name, shape)
        if problem:
            raise StoreError(problem)
        widths[name] = math.prod(shape)
    return widths


def per_token_width_problem(name: str, per_token: Sequence[object]) -> str | None:
    """Why ``name``, of ``per_token`` axes after ``pos``, has no SAELens ``d_in``, or None:
    ``[d]`` and ``[head, d_head]`` (flattened) have one."""
    if 1 <= len(per_token) <= 2:
        return None
    axes = " ".join(map(str, per_token))
    return (
        f"{name} is [pos {axes}] per prompt: SAELens's dataset holds one vector per token "
        f"([pos d], or [pos head d_head] flattened), so it cannot be written there"
    )


def _context_size(prompts: list[dict[str, Any]], wanted: int | None) -> tuple[int, int]:
    """The context size, and how many rows cutting the prompts to it leaves out."""
    if not prompts:
        raise StoreError("the store holds no prompts: fill it with `vlens cache` first")
    lengths = [prompt["stop"] - prompt["start"] for prompt in prompts]
    shortest = min(lengths)
    if wanted is None:
        other = next((i for i, length in enumerate(lengths) if length != lengths[0]), None)
        if other is not None:
            raise StoreError(
                f"prompt {other} has {lengths[other]} tokens and prompt 0 has {lengths[0]}: "
                f"SAELens's contexts all have context_size tokens. Give a context size (--context-"
                f"size N, at most {shortest}, the shortest prompt's) to cut every prompt to its "
                f"first N tokens, or store prompts of one length (a .jsonl of "
                f'{{"tokens": [...]}} lines of N ids each)'
            )
        return lengths[0], 0
    if wanted < 1:
        raise StoreError(f"the context size must be positive, not {wanted}")
    short = [i for i, length in enumerate(lengths) if length < wanted]
    if short:
        raise StoreError(
            f"prompt {short[0]} has {lengths[short[0]]} tokens, fewer than the context size "
            f"{wanted} ({len(short)} prompts are shorter; the shortest has {shortest}): give a "
            f"context size of at most {shortest}, or store only prompts of at least {wanted} "
            f"tokens"
        )
    return wanted, sum(lengths) - wanted * len(lengths)


def _contexts(
    parts: list[tuple[Path, dict[str, Any]]], names: list[str], size: int, dtype: str
) -> Iterator[dict[str, np.ndarray]]:
    """One row of the dataset per stored prompt, in store order, read from its shard alone."""
    for folder, manifest in parts:
        opened: tuple[int, Any] | None = None
        with contextlib.ExitStack() as stack:
            for prompt in manifest["prompts"]:
                if opened is None or opened[0] != prompt["shard"]:
                    stack.close()
                    file = manifest["shards"][prompt["shard"]]["file"]
                    opened = prompt["shard"], stack.enter_context(safe_open(folder / file, "pt"))
                shard, start = opened[1], prompt["start"]
                row = {
                    name: shard.get_slice(name)[start : start + size]
                    .reshape(size, -1)
                    .to(TORCH_DTYPES[dtype])
                    .numpy()
                    for name in names
                }
                row["token_ids"] = np.asarray(prompt["tokens"][:size], dtype=np.int32)
                yield row


def _parts(store_folder: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The stores that make ``store_folder``, with their manifests, in prompt order: itself, or
    the blocks of a store written on Ray (``vlens cache --ray``), which must all be complete."""
    if (store_folder / INDEX).exists():
        parts = []
        for block in index_blocks(read_index(store_folder)):
            folder, manifest = store_folder / block.folder, block_manifest(store_folder, block)
            stored = 0 if manifest is None else len(manifest["prompts"])
            if stored != block.count:
                raise StoreError(
                    f"{folder} holds {stored} of its {block.count} prompts: run the same "
                    f"`vlens cache --ray` command again to complete the store first"
                )
            parts.append((folder, manifest))
        return parts
    manifest = read_manifest(store_folder)
    if manifest is None:
        raise StoreError(
            f"{store_folder} has no {MANIFEST}: it is not a vlens store, or no shard was written "
            f"yet; fill it with `vlens cache` first"
        )
    return [(store_folder, manifest)]


def _already_written(out: Path, record: dict[str, Any], features: Any) -> bool:
    """Whether ``out`` holds the whole dataset of this store and these settings."""
    import datasets

    try:
        if json.loads((out / RECORD).read_text(encoding="utf-8")) != record:
            return False
        dataset = datasets.load_from_disk(str(out))
    except (OSError, ValueError):  # no record, a damaged one, or a dataset that does not load
        return False
    return dataset.num_rows == record["contexts"] and dataset.features == features


def _require_replaceable(out: Path) -> None:
    """Only a dataset this module wrote is replaced: refuse a file, or a folder with other
    contents."""
    if out.is_file() or (out.is_dir() and any(out.iterdir()) and not (out / RECORD).is_file()):
        raise StoreError(
            f"{out} exists and is not a SAELens dataset written from a vlens store: give another "
            f"folder for the dataset, or move it aside"
        )


@contextlib.contextmanager
def _datasets_progress(shown: bool) -> Iterator[None]:
    """``datasets``'s progress bars on or off for a block, as they were afterwards."""
    import datasets

    was = datasets.is_progress_bar_enabled()
    (datasets.enable_progress_bars if shown else datasets.disable_progress_bars)()
    try:
        yield
    finally:
        (datasets.enable_progress_bars if was else datasets.disable_progress_bars)()
