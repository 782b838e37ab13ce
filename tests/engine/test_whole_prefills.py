"""A hook function shared by a call's prompts sees each prompt whole, as TransformerLens gives it,
whatever vLLM's token budget per step: vlens prefills every prompt in one step, and where an
engine cannot take a call's prefill in one step (``max_num_batched_tokens`` below its tokens,
``max_num_seqs`` below its prompts) such a hook is refused before the call runs."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
import transformer_lens.patching as tl_patching
from torch import Tensor

from vlens import HookedVLLM
from vlens.testing.tiny import tiny_model

#: Longer than the step's token budget vLLM gives an engine by default (4,096 on the CPU): the
#: tiny Llama's positions are raised past it (rotary: no table of positions to outgrow).
POSITIONS = 8192
LENGTH = 4200
OVERRIDES = {"max_position_embeddings": POSITIONS}
ANSWERS = torch.tensor([3, 4])  # (correct, incorrect)


def long_prompts() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    clean = torch.randint(2, 500, (1, LENGTH), generator=generator)
    clean[:, 0] = 0
    corrupted = clean.clone()
    corrupted[:, [40, LENGTH - 30]] = (corrupted[:, [40, LENGTH - 30]] + 7) % 500
    return clean, corrupted


def logit_diff(logits: Tensor) -> Tensor:
    final = logits[:, -1].gather(-1, ANSWERS[None].to(logits.device))
    return (final[:, 0] - final[:, 1]).mean()


@pytest.fixture(scope="module")
def long_model(engine_args) -> HookedVLLM:
    return HookedVLLM.from_pretrained(
        tiny_model("llama"), dtype="float32", hf_overrides=OVERRIDES, **engine_args
    )


def test_a_prompt_longer_than_vllms_default_budget_is_prefilled_in_one_step(long_model):
    budget = long_model.engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    assert budget >= POSITIONS > LENGTH  # vLLM's default on this machine would split it
    clean, _ = long_prompts()
    lengths = []
    hook = ("blocks.0.hook_resid_pre", lambda x, hook: lengths.append(x.shape[1]))
    long_model.run_with_hooks(clean, fwd_hooks=[hook])
    assert lengths == [LENGTH]


def test_a_hook_indexing_absolute_positions_sees_the_rows_it_names(long_model):
    clean, _ = long_prompts()
    name, positions = "blocks.1.hook_resid_post", [5, 4096, LENGTH - 1]
    _, cache = long_model.run_with_cache(clean, names_filter=name)
    seen: list[Tensor] = []
    long_model.run_with_hooks(clean, fwd_hooks=[(name, lambda x, h: seen.append(x[:, positions].cpu()))])
    torch.testing.assert_close(seen[0], cache[name][:, positions], rtol=0, atol=0)


def test_transformer_lens_patching_on_a_long_prompt_equals_the_bridge(long_model):
    """``transformer_lens.patching`` itself, on the vlens model and on TransformerLens's bridge:
    the residual patched at a position early in the prompt and at one past the default budget
    moves the metric as the bridge's does."""
    from transformer_lens.model_bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers(
        str(tiny_model("llama")), hf_config_overrides=OVERRIDES, device="cpu", dtype=torch.float32
    )
    bridge.enable_compatibility_mode(no_processing=True)
    clean, corrupted = long_prompts()
    cells = pd.DataFrame([[0, 40], [1, 40], [0, LENGTH - 30]], columns=["layer", "pos"])
    names = lambda name: name.endswith("hook_resid_pre")  # noqa: E731
    _, ours_clean = long_model.run_with_cache(clean, names_filter=names)
    with torch.no_grad():
        _, theirs_clean = bridge.run_with_cache(clean, names_filter=names)
        theirs = tl_patching.generic_activation_patch(
            bridge, corrupted, theirs_clean, logit_diff, tl_patching.layer_pos_patch_setter,
            "resid_pre", index_df=cells,
        )
    ours = tl_patching.generic_activation_patch(
        long_model, corrupted, ours_clean, logit_diff, tl_patching.layer_pos_patch_setter,
        "resid_pre", index_df=cells,
    )
    unpatched = logit_diff(long_model(corrupted))
    assert (theirs - unpatched).abs().min() > 1e-3, "a patch changed nothing: the test is blind"
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_a_shared_hook_that_cannot_see_its_batch_whole_is_refused_before_it_runs(hooked):
    """An engine built with a small ``max_num_batched_tokens`` splits long prefills, and one
    step takes at most ``max_num_seqs`` prompts: a shared hook function would see part of the
    call's batch, so the call is refused before any step runs, naming the setting; per-prompt
    hooks still see each step's rows, and the engine keeps serving."""
    split = hooked("llama", max_num_batched_tokens=16, max_num_seqs=4)
    ran: list[int] = []
    shared = [("blocks.0.hook_resid_pre", lambda x, hook: ran.append(x.shape[0]))]
    with pytest.raises(ValueError, match=r"max_num_batched_tokens >= 40 .*prompt_hooks"):
        split.run_with_hooks(list(range(2, 42)), fwd_hooks=shared)
    with pytest.raises(ValueError, match=r"3 prompt\(s\) \(30 tokens\).*max_num_batched_tokens >= 30"):
        split.generate([list(range(2, 12))] * 3, max_new_tokens=2, fwd_hooks=shared)
    with pytest.raises(ValueError, match=r"max_num_seqs >= 5"):
        split.run_with_hooks([[2, 3]] * 5, fwd_hooks=shared)
    assert ran == []
    seen: list[int] = []
    split(list(range(2, 42)), prompt_hooks=[[("blocks.0.hook_resid_pre", lambda x, hook: seen.append(
        hook.first_position))]])
    assert seen == [0, 16, 32]
    split.run_with_hooks([[2, 3]] * 4, fwd_hooks=shared)  # what fits runs, as one batch
    assert ran == [4]
