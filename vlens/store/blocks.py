"""A store cut into blocks of prompts, each an ordinary store: what several engines fill at once.

``OUT/index.json`` names the prompt file (its size and sha256), the run's settings and the blocks;
``OUT/block-00000/``, ... are stores of their own (:mod:`vlens.store.activations`: manifest,
shards, checks, resume), block ``i`` holding prompts ``i * block_prompts`` up to the next block's
first. Blocks are fixed by ``block_prompts`` alone, never by the number of workers, so any worker
can fill any block, a block cut short resumes on whichever worker gets it next, and the rows are
the same for one worker or many.

The driver never holds the prompts: cutting the file records each block's byte range and first
line, and a worker reads its own range (the prompt file and ``OUT`` must be at the same path on
every node, as on a shared file system).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlens.store.activations import Settings
from vlens.store.inputs import Prompt, prompt_of_line
from vlens.store.manifest import (
    MANIFEST,
    StoreError,
    read_manifest,
    shard_problems,
    verify_report,
    write_atomically,
)

INDEX = "index.json"
INDEX_FORMAT = "vlens-blocks/1"
LOCK = ".lock"


@dataclass(frozen=True)
class Block:
    """Prompts ``first`` to ``first + count`` of the prompt file: bytes ``start:stop`` of it,
    beginning on line ``line``."""

    index: int
    first: int
    count: int
    start: int
    stop: int
    line: int

    @property
    def folder(self) -> str:
        return f"block-{self.index:05d}"


@dataclass(frozen=True)
class PromptFile:
    """The prompt file as the index records it: a run resumed with another file is refused."""

    path: str
    bytes: int
    sha256: str
    prompts: int


# ---- cutting the prompt file ---------------------------------------------------------------------


def cut_prompt_file(path: Path, block_prompts: int) -> tuple[PromptFile, list[Block]]:
    """Read ``path`` once, checking every line's prompt, and cut it into blocks of
    ``block_prompts`` prompts (the last may hold fewer). Memory holds one line at a time."""
    if block_prompts < 1:
        raise StoreError(f"block_prompts must be positive, not {block_prompts}")
    if not path.is_file():
        raise StoreError(f"no prompt file at {path}")
    digest, blocks = hashlib.sha256(), []
    offset = prompts = block_start = block_line = 0
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            digest.update(raw)
            offset += len(raw)
            line = _decoded(raw, path, number)
            if not line.strip():
                continue
            prompt_of_line(line, path, number)  # refuses a bad line before any engine loads
            if prompts % block_prompts == 0:
                block_start, block_line = offset - len(raw), number
            prompts += 1
            if prompts % block_prompts == 0:
                blocks.append(_block(len(blocks), prompts, block_prompts, block_start, offset,
                                     block_line))
    if prompts % block_prompts:
        blocks.append(_block(len(blocks), prompts, prompts % block_prompts, block_start, offset,
                             block_line))
    if not blocks:
        raise StoreError(f"{path} holds no prompt (every line is blank)")
    return PromptFile(str(path.resolve()), offset, digest.hexdigest(), prompts), blocks


def _block(index: int, prompts: int, count: int, start: int, stop: int, line: int) -> Block:
    return Block(index, prompts - count, count, start, stop, line)


def _decoded(raw: bytes, path: Path, number: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise StoreError(f"{path}:{number}: not UTF-8 text ({error})") from None


def block_prompts_of(path: Path, block: Block) -> Iterator[Prompt]:
    """The prompts of ``block``, read from its own bytes of the prompt file."""
    with path.open("rb") as file:
        file.seek(block.start)
        text = file.read(block.stop - block.start)
    for number, line in enumerate(text.decode("utf-8").splitlines(keepends=True), block.line):
        if line.strip():
            yield prompt_of_line(line, path, number)


# ---- the index -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSettings:
    """What a blocked store was made with: the rows of each prompt depend on all of it (a batch's
    composition may change how values round), so a resume must use the same."""

    store: Settings
    block_prompts: int
    batch_size: int
    shard_tokens: int


def open_index(out: Path, settings: RunSettings, prompt_file: PromptFile,
               blocks: list[Block]) -> None:
    """Write ``OUT/index.json``, or check that the one there records the same settings and
    prompt file."""
    record = _index_record(settings, prompt_file, blocks)
    existing = read_index(out) if (out / INDEX).exists() else None
    if existing is None:
        if (out / MANIFEST).exists():
            raise StoreError(
                f"{out} holds a single-engine store ({MANIFEST}): write a run on Ray to another "
                f"folder, or resume this one without --ray"
            )
        out.mkdir(parents=True, exist_ok=True)
        write_atomically(out / INDEX, lambda temp: temp.write_text(_json(record), "utf-8"))
        return
    differences = [
        f"{key} {existing.get(key)!r} (this run: {value!r})"
        for key, value in record.items()
        if key not in ("blocks", "prompt_file") and existing.get(key) != value
    ]
    stored_file = existing.get("prompt_file", {})
    if stored_file.get("sha256") != prompt_file.sha256:
        now = "" if stored_file.get("path") == prompt_file.path else f" {prompt_file.path}"
        differences.append(
            f"the prompt file {stored_file.get('path')} ({stored_file.get('prompts')} prompts, "
            f"sha256 {str(stored_file.get('sha256'))[:12]}…; this run's{now}: "
            f"{prompt_file.prompts} prompts, sha256 {prompt_file.sha256[:12]}…)"
        )
    if differences:
        raise StoreError(
            f"{out / INDEX} was written with {'; '.join(differences)}. Resume with the same "
            f"settings and prompts, or write to another folder."
        )


def read_index(out: Path) -> dict[str, Any]:
    path = out / INDEX
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise StoreError(f"cannot read {path} ({error}): move {out} aside and run again") from None
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        raise StoreError(f"{path} is not a vlens block index ({INDEX_FORMAT})")
    return index


def index_blocks(index: dict[str, Any]) -> list[Block]:
    return [Block(**record) for record in index["blocks"]]


def _index_record(settings: RunSettings, prompt_file: PromptFile,
                  blocks: list[Block]) -> dict[str, Any]:
    store = settings.store
    return {
        "format": INDEX_FORMAT,
        "model": store.model,
        "names": list(store.names),
        "dtype": store.dtype,
        "max_new_tokens": store.max_new_tokens,
        "block_prompts": settings.block_prompts,
        "batch_size": settings.batch_size,
        "shard_tokens": settings.shard_tokens,
        "prompt_file": dataclasses.asdict(prompt_file),
        "blocks": [dataclasses.asdict(block) for block in blocks],
    }


def _json(record: dict[str, Any]) -> str:
    blocks = ",\n".join(f"    {json.dumps(block)}" for block in record["blocks"])
    head = json.dumps({k: v for k, v in record.items() if k != "blocks"}, indent=2)[:-2]
    return f'{head},\n  "blocks": [\n{blocks}\n  ]\n}}\n'


# ---- the blocks' state ---------------------------------------------------------------------------


def block_manifest(out: Path, block: Block) -> dict[str, Any] | None:
    """The manifest of ``block``'s store, or None before it has one."""
    folder = out / block.folder
    return read_manifest(folder) if folder.is_dir() else None


def stored_prompts(out: Path, block: Block) -> int:
    """How many of ``block``'s prompts its store records (0 before it has a manifest)."""
    manifest = block_manifest(out, block)
    return 0 if manifest is None else len(manifest["prompts"])


def blocks_to_fill(
    out: Path, blocks: list[Block], progress: Callable[[Iterable], Iterable] = iter
) -> list[Block]:
    """The blocks that are not complete, or whose shards fail their check (each complete
    block's shards are hashed: a run started again skips only verified blocks)."""
    pending = []
    for block in progress(blocks):
        manifest = block_manifest(out, block)
        whole = manifest is not None and len(manifest["prompts"]) == block.count
        if not whole or shard_problems(out / block.folder, manifest):
            pending.append(block)
    return pending


@contextmanager
def block_lock(folder: Path) -> Iterator[None]:
    """Hold ``folder``'s lock while a worker writes it: a retried block waits for a writer that
    has not died yet instead of writing beside it. The lock goes with its process, so a killed
    worker frees its block; the file names the holder's process."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / LOCK).open("a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.truncate(0)
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# ---- `vlens cache --verify` of a blocked store ---------------------------------------------------


def verify_blocks_report(out: Path) -> tuple[list[str], bool]:
    """Lines saying what each block holds and which fail their checks or are not complete; and
    whether every block is complete and passes."""
    index = read_index(out)
    blocks = index_blocks(index)
    lines, failing, incomplete, rows, prompts = [], 0, [], 0, 0
    for block in blocks:
        manifest = block_manifest(out, block)
        if manifest is None:
            incomplete.append(f"{block.folder}: 0 of {block.count} prompts")
            continue
        block_lines, passed = verify_report(out / block.folder)
        rows += sum(shard["rows"] for shard in manifest["shards"])
        prompts += len(manifest["prompts"])
        if not passed:
            failing += 1
            lines += block_lines[1:-1]
        if len(manifest["prompts"]) != block.count:
            incomplete.append(f"{block.folder}: {len(manifest['prompts'])} of {block.count} "
                              f"prompts")
    total = index["prompt_file"]["prompts"]
    lines.insert(0, f"{out}: {len(blocks)} blocks, {rows} rows, {prompts} of {total} prompts")
    lines += incomplete
    if failing:
        lines.append(f"{failing} blocks have shards that fail their check: run the same "
                     f"`vlens cache` command again to rewrite them")
    if incomplete:
        lines.append(f"{len(incomplete)} of {len(blocks)} blocks are not complete: run the same "
                     f"`vlens cache` command again to fill them")
    if not failing and not incomplete:
        lines.append("every block is complete and every shard passes its check")
    return lines, not failing and not incomplete

