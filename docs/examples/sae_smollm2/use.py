"""The SAE that SAELens trained, back in vlens: one of its features read over a few prompts,
then clamped on in generation, SAELens's way (a hook on ``hook_sae_acts_post`` with the error
term kept, so that only the feature's edit changes the model).

    python docs/examples/sae_smollm2/use.py sae/
"""

from __future__ import annotations

import argparse

import torch

from vlens import HookedVLLM
from vlens.sae import SAE
from vlens.testing.embedded import smollm2_path

PROMPTS = [
    "Open the file for reading and return a stream of bytes from the given path on disk.",
    "The socket connects to the remote host and port, then sends the request over the network.",
    "Return the number of days between two dates in the calendar, counting leap years.",
    "Raise an exception if the argument is not a string or if the list of values is empty.",
]
STORY = "Once upon a time, in a small village,"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sae", help="the folder train.py saved")
    args = parser.parse_args()
    model = HookedVLLM.from_pretrained(smollm2_path(), dtype="float32")
    sae = SAE.load_from_disk(args.sae)
    acts = f"{sae.cfg.hook_name}.hook_sae_acts_post"

    _, cache = model.run_with_cache_with_saes(PROMPTS, saes=[sae], names_filter=[acts])
    features = cache[acts][:, 1:]  # [prompt, pos, d_sae], the first token left out as in training
    # the feature most particular to the first prompt: its mean there against the others'
    mean = features.mean(1)
    feature = int((mean[0] - mean[1:].mean(0)).argmax())
    print(f"feature {feature} of {sae.cfg.d_sae} at {sae.cfg.hook_name}:")
    for index, prompt in enumerate(PROMPTS):
        values = features[index, :, feature]
        tokens = model.to_str_tokens(prompt)[1:]
        top = values.topk(3).indices.tolist()
        shown = ", ".join(f"{tokens[i]!r} {values[i]:.1f}" for i in top)
        print(f"  prompt {index}: mean {values.mean():.2f}, strongest on {shown}")

    strength = float(features[0, :, feature].max()) * 12  # far past what text gives it

    def clamp(value: torch.Tensor, hook) -> None:
        value[..., feature] = strength

    greedy = dict(max_new_tokens=24, do_sample=False, verbose=False)
    plain = model.generate(STORY, **greedy)
    with model.saes(saes=[sae], use_error_term=True):
        unchanged = model.generate(STORY, **greedy)
        steered = model.generate(STORY, fwd_hooks=[(acts, clamp)], **greedy)
    assert unchanged == plain, "with the error term, the SAE alone changes nothing"
    print(f"plain:   {plain!r}")
    print(f"feature {feature} clamped to {strength:.1f}: {steered!r}")


if __name__ == "__main__":
    main()
