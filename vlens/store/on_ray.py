"""``vlens cache --ray``: a blocked store (:mod:`vlens.store.blocks`) filled by engines that Ray
Data schedules, on one machine's GPUs or a cluster's.

Ray only schedules. Its dataset is the list of blocks still to fill (a few numbers each, never the
prompts), mapped by a pool of actors that each hold one ``HookedVLLM`` (``map_batches`` with a
callable class, one block per call). Ray Data restarts an actor that dies and hands the block it
held to a live one, whose store resumes after the shards the dead one recorded; a run started again
skips the blocks that are complete and pass their checks. Everything else (the rows, the shards,
their checks) is the single-engine store's.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from vlens.mappings import checkpoint_specs
from vlens.store.activations import (
    DTYPES,
    ActivationStore,
    Settings,
    fill_store,
    require_writable_folder,
)
from vlens.store.blocks import (
    Block,
    RunSettings,
    block_lock,
    block_prompts_of,
    blocks_to_fill,
    cut_prompt_file,
    open_index,
    stored_prompts,
)
from vlens.store.inputs import stored_names
from vlens.store.manifest import StoreError

#: The driver's environment that the workers get too: vLLM's and vlens's settings, and the
#: threads of a CPU engine (Ray otherwise sets OMP_NUM_THREADS to the worker's CPUs, at least 1).
FORWARDED_ENVIRONMENT = ("VLLM_", "VLENS_", "HF_", "TRANSFORMERS_", "TRITON_", "OMP_NUM_THREADS")


@dataclass(frozen=True)
class Workers:
    """The engines Ray runs: how many, and what each one holds. ``count`` None: as many as the
    cluster's GPUs hold (one without GPUs); ``gpus`` None: ``tensor_parallel_size`` GPUs where the
    cluster has GPUs, none where it has not."""

    count: int | None = None
    gpus: float | None = None
    cpus: float = 1.0
    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class RayRun:
    """What a run did: ``filled`` of ``blocks`` blocks written by this run (the others were
    complete), ``rows`` rows in ``seconds`` by this run's workers."""

    out: Path
    blocks: int
    filled: int
    prompts: int
    rows: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds else 0.0


def write_activations_on_ray(
    model: Path | str,
    prompts: Path | str,
    names: Sequence[str],
    out: Path | str,
    *,
    address: str | None = None,
    workers: Workers = Workers(),
    block_prompts: int = 1024,
    batch_size: int = 32,
    shard_tokens: int = 65536,
    dtype: str = "float32",
    max_new_tokens: int = 0,
    engine_args: dict[str, Any] | None = None,
    progress: bool = True,
) -> RayRun:
    """Store the activations of ``names`` (hook names or globs) for every prompt of the file
    ``prompts`` into the blocked store ``out``, on engines that Ray Data schedules.

    ``address``: the Ray cluster (``"auto"``, ``"ray://host:10001"``, ...); None starts Ray on
    this machine, unless this process is already connected to one. ``block_prompts``: prompts per
    block, the unit a worker writes and a lost worker costs (a multiple of ``batch_size`` keeps
    the batches, and so the rows, those of a single engine). ``engine_args`` go to every
    worker's ``HookedVLLM.from_pretrained``. Every input is checked before Ray starts, with the
    single-engine path's errors.
    """
    model, out, prompts = Path(model), Path(out), Path(prompts)
    if dtype not in DTYPES:
        raise StoreError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    if batch_size < 1 or shard_tokens < 1:
        raise StoreError("batch_size and shard_tokens must be positive")
    _require_worker_shape(workers)
    names = stored_names(names, checkpoint_specs(model))
    store_settings = Settings(str(model.resolve()), tuple(names), dtype, max_new_tokens)
    settings = RunSettings(store_settings, block_prompts, batch_size, shard_tokens)
    require_writable_folder(out)
    prompt_file, blocks = cut_prompt_file(prompts, block_prompts)
    open_index(out, settings, prompt_file, blocks)
    checking = functools.partial(tqdm, desc="checking blocks", unit="block", leave=False,
                                 disable=not progress)
    pending = blocks_to_fill(out, blocks, checking)
    started, rows = time.perf_counter(), 0
    if pending:
        filler = dict(out=str(out), prompts=str(prompts), settings=settings,
                      engine_args={"tensor_parallel_size": workers.tensor_parallel_size,
                                   **(engine_args or {})})
        rows = _fill_on_ray(pending, len(blocks), filler, address, workers, progress)
    seconds = time.perf_counter() - started
    unfinished = [block for block in blocks if stored_prompts(out, block) != block.count]
    if unfinished:
        raise StoreError(f"{len(unfinished)} blocks of {out} are not complete after the run "
                         f"({unfinished[0].folder}): run the same command again")
    return RayRun(out, len(blocks), len(pending), prompt_file.prompts, rows, seconds)


def _require_worker_shape(workers: Workers) -> None:
    if workers.count is not None and workers.count < 1:
        raise StoreError(f"the number of workers must be positive, not {workers.count}")
    if workers.tensor_parallel_size < 1:
        raise StoreError(f"tensor_parallel_size must be positive, not "
                         f"{workers.tensor_parallel_size}")
    if workers.cpus <= 0 or (workers.gpus is not None and workers.gpus < 0):
        raise StoreError("a worker needs a positive number of CPUs and a non-negative number of "
                         "GPUs")


# ---- the driver ----------------------------------------------------------------------------------


def _fill_on_ray(pending: list[Block], total: int, filler: dict[str, Any], address: str | None,
                 workers: Workers, progress: bool) -> int:
    """Map the pending blocks over a pool of :class:`BlockFiller` actors; the rows written."""
    ray = _connect(address)
    count, gpus = _pool(ray.cluster_resources(), workers)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # ours counts blocks, rows and time left
    records = [dataclasses.asdict(block) for block in pending]
    filled = ray.data.from_items(records, override_num_blocks=len(records)).map_batches(
        BlockFiller,
        batch_size=1,
        # A worker writes one block and has the next queued (no pause between blocks); one
        # that dies loses only what it wrote of the first since its last shard.
        compute=ray.data.ActorPoolStrategy(size=count, max_tasks_in_flight_per_actor=2),
        num_gpus=gpus,
        num_cpus=workers.cpus,
        fn_constructor_kwargs=filler,
        runtime_env={"env_vars": _forwarded_environment()},
    )
    rows, started = 0, time.perf_counter()
    bar = tqdm(total=total, initial=total - len(pending), unit="block", desc="blocks",
               disable=not progress)
    with bar:
        try:
            for done in filled.iter_rows():
                rows += int(done["rows"])
                rate = rows / (time.perf_counter() - started)
                bar.set_postfix_str(f"{rate:,.0f} tokens/s, {count} workers", refresh=False)
                bar.update()
        except Exception as error:
            store_error = _store_error_in(error)
            if store_error is None:
                raise
            raise store_error from None
    return rows


def _connect(address: str | None) -> Any:
    try:
        import ray
        import ray.data
    except ModuleNotFoundError:
        raise StoreError("--ray needs Ray Data: pip install 'ray[data]>=2.60' (or vlens[ray])"
                         ) from None
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 logging_level="ERROR")
    return ray


def _pool(resources: dict[str, float], workers: Workers) -> tuple[int, float]:
    """How many workers, and each one's GPUs; refuses a pool the cluster cannot hold (Ray would
    wait for it forever)."""
    cluster_gpus, cluster_cpus = resources.get("GPU", 0.0), resources.get("CPU", 0.0)
    gpus = workers.gpus
    if gpus is None:
        gpus = float(workers.tensor_parallel_size) if cluster_gpus else 0.0
    count = workers.count
    if count is None:
        count = max(1, int(cluster_gpus // gpus)) if gpus else 1
    if count * gpus > cluster_gpus:
        raise StoreError(f"{count} workers of {gpus:g} GPUs need {count * gpus:g} GPUs, and the "
                         f"Ray cluster has {cluster_gpus:g}: ask for fewer workers")
    if count * workers.cpus >= cluster_cpus:
        raise StoreError(
            f"{count} workers of {workers.cpus:g} CPUs take all {cluster_cpus:g} CPUs of the Ray "
            f"cluster, and Ray Data needs some for its own tasks (it would wait forever): ask for "
            f"fewer CPUs per worker (a fraction such as 0.5 is fine) or fewer workers"
        )
    return count, gpus


def _forwarded_environment() -> dict[str, str]:
    return {key: value for key, value in os.environ.items()
            if key.startswith(FORWARDED_ENVIRONMENT)}


def _store_error_in(error: BaseException) -> StoreError | None:
    """The StoreError a worker raised, out of Ray's wrappers: the user sees the single-engine
    path's message."""
    seen = error
    while seen is not None:
        if isinstance(seen, StoreError):
            return StoreError(str(seen))
        seen = seen.__cause__ or seen.__context__
    return None


# ---- the workers ---------------------------------------------------------------------------------


class BlockFiller:
    """A Ray actor holding one engine: fills whole blocks, one per call, each under its lock."""

    def __init__(self, out: str, prompts: str, settings: RunSettings,
                 engine_args: dict[str, Any]) -> None:
        from vlens.hooked.model import HookedVLLM

        self.out, self.prompts, self.settings = Path(out), Path(prompts), settings
        self.model = HookedVLLM.from_pretrained(
            Path(settings.store.model), dtype=settings.store.dtype, **engine_args
        )

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[int]]:
        records = [dict(zip(batch, values)) for values in zip(*batch.values())]
        blocks = [Block(**{key: int(value) for key, value in record.items()})
                  for record in records]
        return {"block": [block.index for block in blocks],
                "rows": [self.fill(block) for block in blocks]}

    def fill(self, block: Block) -> int:
        """Fill ``block`` (resuming what a worker before this one recorded); the rows it wrote."""
        folder = self.out / block.folder
        with block_lock(folder):
            store = ActivationStore.open(folder, self.settings.store)
            before = _rows(store)
            fill_store(self.model, store, block_prompts_of(self.prompts, block),
                       batch_size=self.settings.batch_size,
                       shard_tokens=self.settings.shard_tokens, progress=False)
        if store.stored_prompts != block.count:
            raise StoreError(f"{folder} holds {store.stored_prompts} prompts after it was filled, "
                             f"and its block has {block.count}")
        return _rows(store) - before


def _rows(store: ActivationStore) -> int:
    return sum(shard["rows"] for shard in store.manifest["shards"]) if store.manifest else 0
