"""Train a small standard SAE with SAELens, in SAELens's own environment, on the dataset that
``vlens cache --format saelens`` wrote, and save it in SAELens's format.

    /work/saelens-env/bin/python docs/examples/sae_smollm2/train.py acts/saelens sae/

SAELens's ``ActivationsStore`` reads the cached dataset (no model, no text dataset) and hands its
shuffled ``[1024, 576]`` batches to ``SAETrainer``. Every context's first token is left out
(``exclude_special_tokens``: SmolLM2's ``<|im_start|>``, id 1, starts each prompt); its residual
is ~150 times the others' norm and would dominate the reconstruction loss.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch
from sae_lens import SAETrainer, StandardTrainingSAE, StandardTrainingSAEConfig
from sae_lens.config import SAETrainerConfig
from sae_lens.saes.sae import SAEMetadata
from sae_lens.training.activations_store import ActivationsStore

HOOK = "blocks.15.hook_resid_post"
D_IN = 576  # SmolLM2-135M's d_model
CONTEXT = 48  # vlens cache --context-size
BATCH = 1024
FIRST_TOKEN = 1  # <|im_start|>


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--d-sae", type=int, default=4 * D_IN)
    parser.add_argument("--tokens", type=int, default=600_000, help="training rows in all")
    parser.add_argument("--l1", type=float, default=3.0)
    args = parser.parse_args()
    torch.manual_seed(0)
    store = ActivationsStore(
        model=None,  # type: ignore[arg-type]
        dataset=None, streaming=False, hook_name=HOOK, hook_head_index=None,
        context_size=CONTEXT, d_in=D_IN, n_batches_in_buffer=64, total_training_tokens=10**8,
        store_batch_size_prompts=16, train_batch_size_tokens=BATCH, prepend_bos=False,
        normalize_activations="expected_average_only_in", device=torch.device("cpu"),
        dtype="float32", cached_activations_path=str(args.dataset),
        exclude_special_tokens=torch.tensor([FIRST_TOKEN]),
    )
    sae = StandardTrainingSAE(StandardTrainingSAEConfig(
        d_in=D_IN, d_sae=args.d_sae, l1_coefficient=args.l1, l1_warm_up_steps=50,
        normalize_activations="expected_average_only_in",
        metadata=SAEMetadata(hook_name=HOOK, model_name="SmolLM2-135M-Instruct",
                             context_size=CONTEXT, prepend_bos=False),
    ))
    config = SAETrainerConfig(total_training_samples=args.tokens, train_batch_size_samples=BATCH,
                              lr=4e-4, lr_end=4e-5, lr_scheduler_name="cosineannealing",
                              n_batches_for_norm_estimate=20, device="cpu")
    with warnings.catch_warnings():  # the small dataset starts new epochs; SAELens warns each time
        warnings.simplefilter("ignore")
        trainer = SAETrainer(cfg=config, sae=sae, data_provider=store)
        trained = trainer.fit()
        batch = next(store)
    with torch.no_grad():
        features = trained.encode(batch)
        recons = trained.decode(features)
        explained = 1 - (recons - batch).pow(2).sum() / (batch - batch.mean(0)).pow(2).sum()
        alive = (features > 0).any(0).float().mean()
        print(f"{trainer.n_training_steps} steps: L0 {(features > 0).float().sum(-1).mean():.1f}, "
              f"variance explained {explained:.3f}, features active in a batch {alive:.2f}")
    trained.save_inference_model(str(args.out))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
