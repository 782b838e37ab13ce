"""Tensor parallelism on the CPU backend: two worker processes, one core each. Every name's
cache and steered generation equal those of one rank."""

import pytest
import torch

from vlens import HookedVLLM
from vlens.testing import tiny_model

TEXTS = ["Tensor parallel hooks", "run in every worker process, with the same inputs"]


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def two_ranks(request) -> tuple[str, HookedVLLM]:
    arch = request.param
    return arch, HookedVLLM.from_pretrained(tiny_model(arch), dtype="float32", tensor_parallel_size=2)


def test_every_name_equals_one_rank(two_ranks, hooked):
    arch, parallel = two_ranks
    single = hooked(arch)
    logits, cache = parallel.run_with_cache(TEXTS, max_new_tokens=3)
    expected_logits, expected = single.run_with_cache(TEXTS, max_new_tokens=3)
    assert set(cache.keys()) == set(expected.keys())
    # Two ranks sum partial products in another order (all-reduce): fp32 rounding, far below
    # any misplaced head or shard (errors of order 1).
    for name in expected.keys():
        torch.testing.assert_close(cache[name], expected[name], rtol=1e-4, atol=1e-4, msg=name)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)


def test_steering_a_split_value_equals_one_rank(two_ranks, hooked):
    arch, parallel = two_ranks
    single = hooked(arch)
    generator = torch.Generator().manual_seed(3)
    shift = torch.randn(single.cfg.n_heads, single.cfg.d_head, generator=generator)

    def steer(z, hook):
        if hook.request == 0:
            z[:, :] += shift  # in place, on the whole value: written back as each rank's slice

    hooks = [("blocks.1.attn.hook_z", steer)]
    ours = parallel.generate(TEXTS, max_new_tokens=6, do_sample=False, fwd_hooks=hooks, return_type="tokens")
    theirs = single.generate(TEXTS, max_new_tokens=6, do_sample=False, fwd_hooks=hooks, return_type="tokens")
    assert ours == theirs
    assert ours[0] != single.generate(TEXTS[0], max_new_tokens=6, do_sample=False, return_type="tokens")[0]


def test_raw_locations_are_refused_under_tensor_parallelism(two_ranks):
    _, parallel = two_ranks
    with pytest.raises(NotImplementedError, match="tensor parallelism"):
        parallel.run_with_cache("x", names_filter="model.layers.0.mlp.act_fn.output")
