"""vLLM's prefix cache, kept where it is correct (:mod:`vlens.engine.prefix_cache`): plain
requests share it, a request that reads names computes every position, a hooked one neither
reads others' blocks nor leaves its own, steered ones share blocks only with identical steering."""

from __future__ import annotations

import pytest
import torch
from test_compiled import CAPTURED, STEERED

from vlens import Steer
from vlens.engine.prefix_cache import cache_use, fingerprint
from vlens.runtime.transfer.messages import NamePlan, RequestPlan
from vlens.runtime.vocabulary.locations import Site
from vlens.runtime.vocabulary.readers import OutputOf
from vlens.runtime.vocabulary.steering import as_hook_function

BLOCK = 128  # vLLM's CPU block size: a prefix shorter than one block is never cached


def prompt(seed: int, length: int, prefix: list[int] | None = None) -> list[int]:
    tail = torch.randint(3, 400, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    return (prefix or []) + tail


SHARED = prompt(0, 2 * BLOCK + 10)


def cached_tokens(model, tokens: list[int]) -> int:
    """How many of ``tokens`` a plain vLLM request finds in the prefix cache."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0)
    [output] = model.engine.llm.generate([TokensPrompt(prompt_token_ids=tokens)], params,
                                          use_tqdm=False)
    return output.num_cached_tokens or 0


@pytest.fixture(scope="module")
def cached(hooked):
    model = hooked("llama")
    assert model.engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    return model


@pytest.fixture(scope="module")
def uncached(hooked):
    return hooked("llama", enable_prefix_caching=False)


def test_plain_requests_share_the_cache_and_generate_the_same(cached, uncached):
    prompts = [prompt(1, 20, SHARED), prompt(2, 30, SHARED)]
    ours = cached.generate(prompts, max_new_tokens=6, return_type="tokens", do_sample=False)
    theirs = uncached.generate(prompts, max_new_tokens=6, return_type="tokens", do_sample=False)
    assert torch.equal(ours, theirs)
    assert cached_tokens(cached, prompt(3, 5, SHARED)) >= 2 * BLOCK


def test_a_capture_computes_every_position_and_fills_the_cache(cached, uncached):
    tokens = torch.tensor([prompt(4, 40, SHARED)])
    name = "blocks.1.hook_resid_post"
    cached.run_with_cache(tokens, names_filter=name)  # its prefix is now cached
    _, again = cached.run_with_cache(tokens, names_filter=name)
    _, reference = uncached.run_with_cache(tokens, names_filter=name)
    assert again[name].shape == reference[name].shape
    torch.testing.assert_close(again[name], reference[name], rtol=1e-5, atol=1e-5)
    fresh = prompt(5, 3 * BLOCK)
    cached.run_with_cache(torch.tensor([fresh]), names_filter=name)
    assert cached_tokens(cached, fresh + [7]) >= 2 * BLOCK  # what it computed serves others


def test_a_hooked_request_neither_reads_nor_leaves_blocks(cached, uncached):
    fresh = prompt(6, 3 * BLOCK)

    def scramble(resid, hook):
        return resid * -3.0

    hooked_logits = cached.run_with_hooks(
        torch.tensor([fresh]), fwd_hooks=[("blocks.0.hook_resid_post", scramble)]
    )
    assert cached_tokens(cached, fresh + [7]) == 0  # its edited blocks serve nobody
    reference = uncached.run_with_hooks(
        torch.tensor([fresh]), fwd_hooks=[("blocks.0.hook_resid_post", scramble)]
    )
    torch.testing.assert_close(hooked_logits, reference, rtol=1e-5, atol=1e-5)
    # a hooked request on a cached prefix computes it anew
    cached.generate([SHARED], max_new_tokens=1, do_sample=False)
    again = cached.run_with_hooks(
        torch.tensor([SHARED]), fwd_hooks=[("blocks.0.hook_resid_post", scramble)]
    )
    reference = uncached.run_with_hooks(
        torch.tensor([SHARED]), fwd_hooks=[("blocks.0.hook_resid_post", scramble)]
    )
    torch.testing.assert_close(again, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tier", ["compiled", "eager"])
def test_steered_tokens_equal_those_without_the_cache(hooked, uncached, tier):
    """Steers as data in the graph, or as the hook functions an eager engine makes of them:
    either way the requests steered alike share cached blocks."""
    compiled = (hooked("llama", compiled_capture=CAPTURED, compiled_steering=STEERED)
                if tier == "compiled" else hooked("llama"))
    name = "blocks.1.hook_resid_post"
    vector = torch.randn(compiled.cfg.d_model, generator=torch.Generator().manual_seed(9)) * 4
    prompts = [prompt(10, 12, SHARED), prompt(11, 20, SHARED), prompt(12, 8)]
    for steer in (
        Steer(name, add=vector),
        Steer(name, add=vector, positions=slice(BLOCK + 5, None)),  # from inside the prefix
        Steer(name, add=-vector, positions=[3, 2 * BLOCK + 1]),
    ):
        for _ in range(2):  # the second time, its blocks are in the cache
            ours = compiled.generate(prompts, max_new_tokens=5, return_type="tokens",
                                     do_sample=False, steering=[steer])
            theirs = uncached.generate(prompts, max_new_tokens=5, return_type="tokens",
                                       do_sample=False, steering=[steer])
            assert torch.equal(ours, theirs), steer
    plain = compiled.generate(prompts, max_new_tokens=5, return_type="tokens", do_sample=False)
    assert torch.equal(plain, uncached.generate(prompts, max_new_tokens=5, return_type="tokens",
                                                do_sample=False))


# ---- the rules ---------------------------------------------------------------------------------

SITE = Site("model.layers.0", "output")


def plan(hooks=(), keep=False, steering=()) -> RequestPlan:
    names = (NamePlan("blocks.0.hook_resid_post", OutputOf(0, plus=1), None, hooks, keep),)
    return RequestPlan(0, {SITE: names} if hooks or keep else {}, steering=steering)


def test_the_rules():
    assert cache_use(plan()).read and cache_use(plan()).salt is None
    reads = cache_use(plan(keep=True))
    assert not reads.read and reads.salt is None
    first, second = cache_use(plan(hooks=(print,))), cache_use(plan(hooks=(print,)))
    assert not first.read and first.salt != second.salt  # each its own
    vector = torch.ones(8)
    steered = cache_use(plan(steering=(Steer("x", add=vector),)))
    assert steered.read and steered.salt == cache_use(plan(steering=(Steer("x", add=vector),))).salt
    assert not cache_use(plan(keep=True, steering=(Steer("x", add=vector),))).read
    as_hook = as_hook_function(Steer("x", add=vector), 8)  # an eager engine's steer
    eager = cache_use(plan(hooks=(as_hook,)))
    assert eager.read and eager.salt == steered.salt
    assert not cache_use(plan(hooks=(as_hook, print))).read


@pytest.mark.parametrize(
    "other",
    [
        Steer("x", add=torch.ones(8) * 2),
        Steer("y", add=torch.ones(8)),
        Steer("x", add=torch.ones(8), scale=2.0),
        Steer("x", add=torch.ones(8), positions=[0, 1]),
        Steer("x", add=torch.ones(8), positions=slice(4, None)),
        Steer("x", add=torch.ones(8), gain=0.5),
        Steer("x", add=torch.ones(8, dtype=torch.bfloat16)),
    ],
)
def test_a_different_steer_has_a_different_fingerprint(other):
    assert fingerprint((Steer("x", add=torch.ones(8)),)) != fingerprint((other,))
