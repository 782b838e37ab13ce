"""SAELens itself reads the dataset that ``vlens cache --format saelens`` writes.

Run in SAELens's own environment (SAELens requires transformer-lens < 4, vlens 4.x), on a dataset
folder, one hook name of it, its ``d_in`` and context size::

    /work/saelens-env/bin/python parity/saelens_cache_check.py DATASET_DIR HOOK_NAME D_IN CONTEXT_SIZE

It builds SAELens's own ``ActivationsStore`` on the cached path (no model and no dataset are
needed for that: its constructor loads the folder with ``datasets.load_from_disk``, sets the
torch format and checks the column's ``Array2D`` shape against ``(context_size, d_in)``), then:

1. reads every batch of contexts SAELens's training reads (``get_raw_llm_batch``: consecutive
   rows, ``[batch * context_size, d_in]`` and the token ids) and prints the first ones' shapes
   and sums; where the vlens store is beside the dataset (``DATASET_DIR/..``, or ``--store``),
   it checks that they equal the store's rows and token ids, read straight from its
   safetensors shards and manifest;
2. prints a few of the shuffled training batches SAELens's ``ActivationsStore`` hands out
   (``next(store)``, through its mixing buffer);
3. trains a small standard SAE for a few steps with SAELens's ``SAETrainer`` on that store.

Exit status 1 if a batch differs from the store.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import datasets
import safetensors
import torch
from sae_lens import SAETrainer, StandardTrainingSAE, StandardTrainingSAEConfig
from sae_lens.config import SAETrainerConfig
from sae_lens.training.activations_store import ActivationsStore

CONTEXTS_PER_BATCH = 2
TRAIN_BATCH_TOKENS = 16
TRAIN_STEPS = 5


def activations_store(args: argparse.Namespace, dtype: str) -> ActivationsStore:
    """SAELens's store on the cached dataset; model and dataset stay unset, as the cached path
    reads neither."""
    return ActivationsStore(
        model=None,  # type: ignore[arg-type]
        dataset=None,
        streaming=False,
        hook_name=args.hook_name,
        hook_head_index=None,
        context_size=args.context_size,
        d_in=args.d_in,
        n_batches_in_buffer=4,
        total_training_tokens=10**6,
        store_batch_size_prompts=CONTEXTS_PER_BATCH,
        train_batch_size_tokens=TRAIN_BATCH_TOKENS,
        prepend_bos=False,
        normalize_activations="none",
        device=torch.device("cpu"),
        dtype=dtype,
        cached_activations_path=str(args.dataset),
    )


def store_rows(store: Path, hook_name: str, context_size: int) -> list[tuple[torch.Tensor, list]]:
    """Each stored prompt's first ``context_size`` rows of ``hook_name`` (flattened per token)
    and token ids, read from the vlens store's shards without vlens."""
    manifest = json.loads((store / "manifest.json").read_text())
    rows = []
    for prompt in manifest["prompts"]:
        file = store / manifest["shards"][prompt["shard"]]["file"]
        with safetensors.safe_open(file, "pt") as shard:
            value = shard.get_slice(hook_name)[prompt["start"] : prompt["start"] + context_size]
        rows.append((value.reshape(context_size, -1).float(), prompt["tokens"][:context_size]))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", type=Path, help="the dataset folder (OUT/saelens)")
    parser.add_argument("hook_name")
    parser.add_argument("d_in", type=int)
    parser.add_argument("context_size", type=int)
    parser.add_argument("--store", type=Path, help="the vlens store (default: DATASET/.. when "
                        "it holds a manifest.json)")
    args = parser.parse_args()
    torch.manual_seed(0)  # SAELens's mixing buffer and SAE initialisation draw from torch's RNG
    store = args.store or args.dataset.resolve().parent
    compare = (store / "manifest.json").is_file()
    import sae_lens

    print(f"SAELens {sae_lens.__version__}, datasets {datasets.__version__}, torch "
          f"{torch.__version__}")

    dtype = datasets.load_from_disk(str(args.dataset)).features[args.hook_name].dtype
    sae_store = activations_store(args, dtype)
    cached = sae_store.cached_activation_dataset
    print(f"loaded: {cached.num_rows} contexts, columns {cached.column_names}, "
          f"{args.hook_name} {cached.features[args.hook_name]}")

    expected = store_rows(store, args.hook_name, args.context_size) if compare else []
    batches, differing = 0, 0
    while True:
        try:
            acts, tokens = sae_store.get_raw_llm_batch(raise_on_epoch_end=True)
        except StopIteration:
            break
        first = batches * CONTEXTS_PER_BATCH
        if batches < 3:
            print(f"raw batch {batches}: acts {tuple(acts.shape)} sum {acts.double().sum():.6f}, "
                  f"token_ids {tuple(tokens.shape)} sum {int(tokens.double().sum())}")
        if compare:
            window = expected[first : first + CONTEXTS_PER_BATCH]
            want_acts = torch.cat([rows for rows, _ in window])
            want_tokens = torch.tensor([t for _, ids in window for t in ids], dtype=torch.float64)
            if not (torch.equal(acts.float(), want_acts)
                    and torch.equal(tokens.double(), want_tokens)):
                differing += 1
                print(f"raw batch {batches} differs from the store's contexts {first}..")
        batches += 1
    unread = cached.num_rows - batches * CONTEXTS_PER_BATCH
    print(f"{batches} raw batches of {CONTEXTS_PER_BATCH} contexts read ({unread} contexts left "
          f"for the next epoch, as SAELens reads whole batches)")
    if compare:
        verdict = "equal" if not differing else f"{differing} differ"
        print(f"against the vlens store in {store}: {verdict}")

    sae = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=args.d_in, d_sae=2 * args.d_in))
    config = SAETrainerConfig(total_training_samples=TRAIN_STEPS * TRAIN_BATCH_TOKENS,
                              train_batch_size_samples=TRAIN_BATCH_TOKENS, lr_end=3e-4)
    with warnings.catch_warnings():  # a small dataset starts new epochs: SAELens warns each time
        warnings.simplefilter("ignore")
        mixed = activations_store(args, dtype)
        for index in range(3):
            batch = next(mixed)
            print(f"training batch {index}: {tuple(batch.shape)} sum {batch.double().sum():.6f}")
        trained = SAETrainer(cfg=config, sae=sae, data_provider=activations_store(args, dtype))
        trained.fit()
    print(f"SAETrainer: {trained.n_training_steps} steps, {trained.n_training_samples} samples")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
