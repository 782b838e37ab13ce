"""Activations of many prompts on disk, one row per token: the training set of a sparse autoencoder.

A store is a folder of safetensors shards plus ``manifest.json``. Every shard holds, for each hook
name, a ``[rows, ...]`` tensor; the rows are the tokens of whole prompts, concatenated in prompt
order without padding. The manifest says which model, names, shapes and dtype were stored and, for
each prompt, its shard, its row range in that shard and its token ids.

Writing streams: prompts run through vLLM one batch at a time and a shard is written as soon as it
is full, so memory holds at most one shard and one batch. Writing resumes: a shard is written under
a temporary name and renamed once on disk, and only then recorded in the manifest (itself replaced
by rename), so an interrupted run leaves a manifest that names only whole shards; the next run
deletes anything else and carries on after the last recorded prompt. The manifest records each
shard's size and sha256, and a resume checks them first: it rewrites a shard that fails its check
by running that shard's prompts again (see :mod:`vlens.store.manifest`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import itertools
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor
from tqdm import tqdm

from vlens.hooked.model import HookedVLLM
from vlens.store.inputs import Prompt, stored_names
from vlens.store.manifest import (
    FORMAT,
    MANIFEST,
    MANIFEST_TEMP,
    SHARD_GLOB,
    TEMP_SUFFIX,
    StoreError,
    checksums,
    read_manifest,
    shard_problems,
    write_atomically,
    write_manifest,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# ---- the folder ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """What a store was made with; resuming with anything else would mix two data sets."""

    model: str
    names: tuple[str, ...]
    dtype: str
    max_new_tokens: int


class ActivationStore:
    """A store folder being written: its manifest in memory, appended one whole shard at a time.
    ``damaged`` maps each recorded shard that failed its check when the store was opened to what
    is wrong with it; :func:`fill_store` rewrites those first."""

    def __init__(self, folder: Path, settings: Settings, manifest: dict[str, Any] | None) -> None:
        self.folder = folder
        self.settings = settings
        self.manifest = manifest
        self.damaged: dict[int, str] = {}

    @classmethod
    def open(cls, folder: Path, settings: Settings, progress: bool = False) -> ActivationStore:
        """Open ``folder`` to write or resume: refuses a folder it cannot write and a manifest made
        with other settings, removes what an interrupted run left unrecorded, and checks every
        recorded shard."""
        require_writable_folder(folder)
        manifest = read_manifest(folder)
        if manifest is not None:
            _require_same_settings(manifest, settings, folder / MANIFEST)
        store = cls(folder, settings, manifest)
        store._remove_unrecorded()
        if manifest is not None:
            store._check_shards(progress)
        return store

    @property
    def stored_prompts(self) -> int:
        return 0 if self.manifest is None else len(self.manifest["prompts"])

    def prompt_tokens(self, index: int) -> list[int]:
        """Stored prompt ``index``'s own token ids (without generated ones)."""
        entry = self.manifest["prompts"][index]
        return entry["tokens"][: entry["prompt_length"]]

    def shard_prompts(self, index: int) -> list[dict[str, Any]]:
        """The manifest's records of the prompts in shard ``index``, in order."""
        return [prompt for prompt in self.manifest["prompts"] if prompt["shard"] == index]

    def add_shard(self, tensors: dict[str, Tensor], prompts: list[dict[str, Any]]) -> None:
        """Write one shard, then record it and its prompts: the manifest never names a partial
        file."""
        if self.manifest is None:
            self.manifest = self._new_manifest(tensors)
        index = len(self.manifest["shards"])
        self.manifest["shards"].append(self._write_shard(index, tensors))
        self.manifest["prompts"].extend({"shard": index, **prompt} for prompt in prompts)
        write_manifest(self.folder, self.manifest)

    def rewrite_shard(self, index: int, tensors: dict[str, Tensor]) -> None:
        """Replace damaged shard ``index`` with ``tensors``, its prompts' rows computed again."""
        self.manifest["shards"][index] = self._write_shard(index, tensors)
        write_manifest(self.folder, self.manifest)
        del self.damaged[index]

    def _write_shard(self, index: int, tensors: dict[str, Tensor]) -> dict[str, Any]:
        """Write shard ``index``; its record for the manifest."""
        path = self.folder / f"shard-{index:05d}.safetensors"
        write_atomically(path, lambda temp: save_file(tensors, temp))
        rows = next(iter(tensors.values())).shape[0]
        return {"file": path.name, "rows": rows, **checksums(path)}

    def _new_manifest(self, tensors: dict[str, Tensor]) -> dict[str, Any]:
        import vllm

        return {
            "format": FORMAT,
            "model": self.settings.model,
            "dtype": self.settings.dtype,
            "max_new_tokens": self.settings.max_new_tokens,
            "names": {
                name: {
                    "shape": list(tensors[name].shape[1:]),
                    "dtype": str(tensors[name].dtype).removeprefix("torch."),
                }
                for name in self.settings.names
            },
            "versions": {
                "vlens": _installed_version("vlens"),
                "vllm": vllm.__version__,
                "torch": torch.__version__,
            },
            "shards": [],
            "prompts": [],
        }

    def _remove_unrecorded(self) -> None:
        """Temporary files, and shards the manifest does not name, are what an interruption left."""
        recorded = {shard["file"] for shard in (self.manifest or {"shards": []})["shards"]}
        leftovers = [path for path in self.folder.glob(SHARD_GLOB) if path.name not in recorded]
        leftovers += [*self.folder.glob(SHARD_GLOB + TEMP_SUFFIX), self.folder / MANIFEST_TEMP]
        for path in leftovers:
            path.unlink(missing_ok=True)

    def _check_shards(self, progress: bool) -> None:
        """Find the shards that fail their check. Readable shards that an older manifest recorded
        without checksums get theirs now, so that later checks compare bytes."""
        bar = functools.partial(
            tqdm, desc="checking shards", unit="shard", leave=False, disable=not progress
        )
        self.damaged = shard_problems(self.folder, self.manifest, bar)
        shards = self.manifest["shards"]
        unrecorded = [i for i, shard in enumerate(shards) if "sha256" not in shard]
        readable = [index for index in unrecorded if index not in self.damaged]
        for index in readable:
            shards[index].update(checksums(self.folder / shards[index]["file"]))
        if readable:
            write_manifest(self.folder, self.manifest)


def require_writable_folder(folder: Path) -> None:
    """Refuse, before any work, a store folder that is a file, lies under one, or is not
    writable."""
    try:
        existing = next(path for path in [folder, *folder.parents] if path.exists())
        if not existing.is_dir():
            raise StoreError(
                f"{existing} is a file, and a store is a folder: give a folder's path (a new one, "
                f"or a store to resume)"
            )
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise StoreError(
            f"cannot write to {folder} ({error.strerror}): give a folder you can write to"
        ) from None


def _installed_version(distribution: str) -> str | None:
    """None when running from a source tree that was never installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _require_same_settings(manifest: dict[str, Any], settings: Settings, where: Path) -> None:
    stored = Settings(
        manifest["model"], tuple(manifest["names"]), manifest["dtype"], manifest["max_new_tokens"]
    )
    differences = [
        f"{field.name} {getattr(stored, field.name)} (this run: {getattr(settings, field.name)})"
        for field in dataclasses.fields(Settings)
        if getattr(stored, field.name) != getattr(settings, field.name)
    ]
    if differences:
        raise StoreError(
            f"{where} was written with {'; '.join(differences)}. Resume with the same settings, "
            f"or write to another folder."
        )


# ---- filling a shard -----------------------------------------------------------------------------


class ShardBuffer:
    """The rows of the shard being filled. Preallocated at ``capacity`` rows, so that writing it
    needs no second copy; a shard holds whole prompts, and a prompt longer than ``capacity`` gets a
    shard of its own."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._empty()

    def _empty(self) -> None:
        self.rows = 0
        self.tensors: dict[str, Tensor] = {}
        self.prompts: list[dict[str, Any]] = []

    def fits(self, rows: int) -> bool:
        return self.rows == 0 or self.rows + rows <= self.capacity

    @property
    def full(self) -> bool:
        return self.rows >= self.capacity

    def add(self, values: dict[str, Tensor], tokens: list[int], prompt_length: int) -> None:
        rows = len(tokens)
        if not self.tensors:
            size = max(self.capacity, rows)
            self.tensors = {n: v.new_empty((size, *v.shape[1:])) for n, v in values.items()}
        for name, value in values.items():
            self.tensors[name][self.rows : self.rows + rows] = value
        start, self.rows = self.rows, self.rows + rows
        self.prompts.append(
            {"start": start, "stop": self.rows, "prompt_length": prompt_length, "tokens": tokens}
        )

    def contents(self) -> dict[str, Tensor]:
        """The filled rows of every name."""
        return {name: tensor[: self.rows] for name, tensor in self.tensors.items()}

    def flush(self, store: ActivationStore) -> None:
        if self.rows:
            store.add_shard(self.contents(), self.prompts)
        self._empty()


# ---- running ---------------------------------------------------------------------------------


def open_store(
    out: Path,
    model_path: Path,
    names: Sequence[str],
    dtype: str,
    max_new_tokens: int,
    progress: bool = False,
) -> ActivationStore:
    """Open ``out`` for these settings (see :meth:`ActivationStore.open`)."""
    if dtype not in DTYPES:
        raise StoreError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    settings = Settings(str(Path(model_path).resolve()), tuple(names), dtype, max_new_tokens)
    return ActivationStore.open(Path(out), settings, progress)


def write_activations(
    model: HookedVLLM,
    prompts: Iterable[Prompt],
    names: Sequence[str],
    out: Path,
    *,
    batch_size: int = 32,
    shard_tokens: int = 65536,
    dtype: str = "float32",
    max_new_tokens: int = 0,
    total: int | None = None,
    progress: bool = True,
) -> ActivationStore:
    """Store the activations of ``names`` (hook names or globs) for every prompt into ``out``,
    resuming after the prompts an earlier run stored there (see :func:`fill_store`)."""
    names = stored_names(names, model.checkpoint.hook_specs)
    store = open_store(out, model.checkpoint.path, names, dtype, max_new_tokens, progress)
    return fill_store(
        model, store, prompts, batch_size=batch_size, shard_tokens=shard_tokens, total=total,
        progress=progress,
    )


def fill_store(
    model: HookedVLLM,
    store: ActivationStore,
    prompts: Iterable[Prompt],
    *,
    batch_size: int = 32,
    shard_tokens: int = 65536,
    total: int | None = None,
    progress: bool = True,
) -> ActivationStore:
    """Rewrite the shards of ``store`` that failed their check, then store the prompts after those
    it holds.

    ``prompts`` must give the same prompts, in the same order, as in the run being resumed (the
    last stored prompt is checked). ``total`` (the number of prompts) sizes the progress bar.
    """
    if batch_size < 1 or shard_tokens < 1:
        raise StoreError("batch_size and shard_tokens must be positive")
    unstored = _unstored(model, prompts, store)  # refuses other prompts before any work
    for index in sorted(store.damaged):
        _rewrite_shard(model, store, index, batch_size)
    buffer = ShardBuffer(shard_tokens)
    bar = tqdm(total=total, initial=store.stored_prompts, unit="prompt", disable=not progress)
    with bar:
        for values, tokens, prompt_length in _activations(model, store, unstored, batch_size):
            if not buffer.fits(len(tokens)):
                buffer.flush(store)
            buffer.add(values, tokens, prompt_length)
            if buffer.full:
                buffer.flush(store)
            bar.update()
        buffer.flush(store)
    return store


REWRITTEN = ("start", "stop", "prompt_length", "tokens")  # what a rewritten shard's prompts keep


def _rewrite_shard(model: HookedVLLM, store: ActivationStore, index: int, batch_size: int) -> None:
    """Run the prompts of shard ``index`` again and write it anew; they must give the rows and
    tokens that the manifest records."""
    recorded = store.shard_prompts(index)
    buffer = ShardBuffer(store.manifest["shards"][index]["rows"])
    own_tokens = (prompt["tokens"][: prompt["prompt_length"]] for prompt in recorded)
    for values, tokens, prompt_length in _activations(model, store, own_tokens, batch_size):
        buffer.add(values, tokens, prompt_length)
    if buffer.prompts != [{key: p[key] for key in REWRITTEN} for p in recorded]:
        raise StoreError(
            f"shard {index} of {store.folder} cannot be rewritten: its prompts, run again, give "
            f"other tokens than {MANIFEST} records (a different greedy continuation); write the "
            f"store again to another folder"
        )
    store.rewrite_shard(index, buffer.contents())


def _activations(
    model: HookedVLLM, store: ActivationStore, token_lists: Iterable[list[int]], batch_size: int
) -> Iterator[tuple[dict[str, Tensor], list[int], int]]:
    """For each prompt, its rows of every stored name, the token ids at those rows, and its own
    length: ``batch_size`` prompts to one vLLM call."""
    names, dtype = list(store.settings.names), store.settings.dtype
    for batch in _batches(token_lists, batch_size):
        _, cache = model.run_with_cache(
            batch, names_filter=names, return_type=None,
            max_new_tokens=store.settings.max_new_tokens,
        )
        for index, prompt in enumerate(batch):
            length = int(cache.lengths[index])
            values = {name: _as(cache.unpadded(name, index), dtype) for name in names}
            yield values, cache.tokens[index, :length].tolist(), len(prompt)


def _unstored(
    model: HookedVLLM, prompts: Iterable[Prompt], store: ActivationStore
) -> Iterator[list[int]]:
    """The token ids of the prompts after those already stored; the last stored one must match
    what the store recorded, or the prompts are not those of the run being resumed."""
    prompts = iter(prompts)
    done = store.stored_prompts
    if done:
        last = next(itertools.islice(prompts, done - 1, None), None)
        if last is None or _tokens(model, last) != store.prompt_tokens(done - 1):
            raise StoreError(
                f"prompt {done - 1} is not the one stored in {store.folder}: resume with the same "
                f"prompts, in the same order"
            )
    return (_tokens(model, prompt) for prompt in prompts)


def _as(value: Tensor, dtype: str) -> Tensor:
    """Floating values in the store's dtype; integers (expert indices) stay exact."""
    return value.to(DTYPES[dtype]) if value.is_floating_point() else value


def _tokens(model: HookedVLLM, prompt: Prompt) -> list[int]:
    return model.token_lists(prompt if isinstance(prompt, str) else [prompt])[0]


def _batches(items: Iterable[list[int]], size: int) -> Iterator[list[list[int]]]:
    items = iter(items)
    while batch := list(itertools.islice(items, size)):
        yield batch
