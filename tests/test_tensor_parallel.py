"""Tensor parallelism on the CPU backend: two worker processes, one core each. Every name's
cache and steered generation equal those of one rank."""

import pytest
import torch

from vlens import HookedVLLM
from vlens.testing import tiny_archs, tiny_model

TEXTS = ["Tensor parallel hooks", "run in every worker process, with the same inputs"]


@pytest.fixture(scope="module", params=tiny_archs(lambda mapping: mapping.tensor_parallel))
def two_ranks(request) -> tuple[str, HookedVLLM]:
    arch = request.param
    return arch, HookedVLLM.from_pretrained(
        tiny_model(arch), dtype="float32", tensor_parallel_size=2, kv_cache_memory_bytes=64 * 2**20
    )


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
        z[:, :] += shift  # in place, on the whole value: written back as each rank's slice

    hooks = [[("blocks.1.attn.hook_z", steer)], []]  # prompt 0 only
    ours = parallel.generate(TEXTS, max_new_tokens=6, do_sample=False, prompt_hooks=hooks, return_type="tokens")
    theirs = single.generate(TEXTS, max_new_tokens=6, do_sample=False, prompt_hooks=hooks, return_type="tokens")
    assert ours == theirs
    assert ours[0] != single.generate(TEXTS[0], max_new_tokens=6, do_sample=False, return_type="tokens")[0]


def test_a_shared_hook_on_the_batch_equals_one_rank(two_ranks, hooked):
    """Equal-length prompts: every rank runs the shared hook once on the batch (it indexes prompt
    1 of it; a per-prompt call would fail), with the split value gathered and written back."""
    arch, parallel = two_ranks
    single = hooked(arch)
    tokens = torch.randint(2, 500, (2, 6), generator=torch.Generator().manual_seed(4))
    shift = torch.randn(single.cfg.n_heads, single.cfg.d_head, generator=torch.Generator().manual_seed(5))

    def steer_second(z, hook):
        assert z.shape[0] == 2 and hook.requests == (0, 1)
        z[1] += shift

    hooks = [("blocks.1.attn.hook_z", steer_second)]
    ours = parallel.generate(tokens, max_new_tokens=6, do_sample=False, fwd_hooks=hooks, return_type="tokens")
    theirs = single.generate(tokens, max_new_tokens=6, do_sample=False, fwd_hooks=hooks, return_type="tokens")
    assert ours == theirs
    plain = single.generate(tokens, max_new_tokens=6, do_sample=False, return_type="tokens")
    assert ours[0] == plain[0] and ours[1] != plain[1]


def test_raw_locations_are_refused_under_tensor_parallelism(two_ranks):
    _, parallel = two_ranks
    with pytest.raises(NotImplementedError, match="tensor parallelism"):
        parallel.run_with_cache("x", names_filter="model.layers.0.mlp.act_fn.output")


def test_worker_processes_import_neither_the_facade_nor_transformer_lens():
    """A spawned worker (as on a GPU, where vLLM never forks) loads vlens's runtime only, and
    vLLM's channels are not opened to pickled payloads (``VLLM_ALLOW_INSECURE_SERIALIZATION``
    stays unset in the user's process and in the workers)."""
    import subprocess
    import sys

    script = """
import os, sys
os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
from vlens import HookedVLLM
from vlens.testing import tiny_model
model = HookedVLLM.from_pretrained(tiny_model("llama"), dtype="float32", tensor_parallel_size=2)
model.run_with_cache("spawned workers", names_filter="blocks.0.hook_resid_post")
print("INSECURE", os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION", "unset"))
def loaded(worker):
    insecure = os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION", "unset")
    return insecure, sorted(m for m in sys.modules if m.split(".")[0] in ("vlens", "transformer_lens"))
import cloudpickle
cloudpickle.register_pickle_by_value(sys.modules[__name__])
for insecure, modules in model.engine.llm.collective_rpc(loaded):
    print("WORKER", insecure, " ".join(modules))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600
    )
    workers = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("WORKER")]
    assert len(workers) == 2, result.stderr[-3000:]
    assert "INSECURE unset" in result.stdout
    for insecure, *modules in workers:
        assert insecure == "unset"
        assert "vlens.runtime.worker" in modules  # the runtime did run there
        assert not [m for m in modules if m.startswith("transformer_lens")], modules
        assert "vlens.hooked" not in modules and "vlens.cache" not in modules, modules
