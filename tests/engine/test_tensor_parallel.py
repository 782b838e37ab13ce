"""Tensor parallelism on the CPU backend: two worker processes, one core each. Every name's
cache and steered generation equal those of one rank."""

import gc
import os
from collections.abc import Iterator

import pytest
import torch

from vlens import HookedVLLM
from vlens.testing.tiny import sweep, tiny_archs, tiny_model

TEXTS = ["Tensor parallel hooks", "run in every worker process, with the same inputs"]


#: Every architecture under ``VLENS_TEST_EVERY_ARCH=1``; else one per way of splitting.
SPLIT = {
    "llama": "qkv_proj and gate_up_proj split per head and per unit",
    "gpt2": "Conv1D's fused qkv",
    "gemma3": "per-head q/k norms",
    "bloom": "ALiBi's slopes, per rank",
    "falcon": "one key/value head every rank holds whole; a parallel block's partial sums",
    "cohere": "a parallel block's attention and MLP outputs, partial sums",
    "qwen2_moe": "experts, a shared expert's partial sum",
    "deepseek_v2": "multi-head latent attention's heads",
    "gpt_neox": "vLLM's Transformers backend, its joint qkv",
}


@pytest.fixture(scope="module", params=sweep(tiny_archs(lambda mapping: mapping.tensor_parallel), SPLIT))
def two_ranks(request, engine_args) -> Iterator[tuple[str, HookedVLLM]]:
    """Each architecture's two-rank engine, closed before the next one's is built: a tiny
    model's two worker processes hold ~0.6 GB, too much to keep for every architecture."""
    arch = request.param
    with HookedVLLM.from_pretrained(
        tiny_model(arch), dtype="float32", tensor_parallel_size=2, **engine_args
    ) as model:
        yield arch, model


def test_every_name_equals_one_rank(two_ranks, hooked):
    arch, parallel = two_ranks
    single = hooked(arch)
    logits, cache = parallel.run_with_cache(TEXTS, max_new_tokens=3)
    expected_logits, expected = single.run_with_cache(TEXTS, max_new_tokens=3)
    assert set(cache.keys()) == set(expected.keys())
    # Two ranks sum partial products in another order (all-reduce): fp32 rounding, far below
    # any misplaced head or shard (errors of order 1).
    for name in expected.keys():
        torch.testing.assert_close(cache[name], expected[name], rtol=1e-4, atol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)


def test_steering_a_split_value_equals_one_rank(two_ranks, hooked):
    arch, parallel = two_ranks
    single = hooked(arch)

    def steer(z, hook):
        # in place, on the whole value: written back as each rank's slice
        z[:, :] += head_shift(z, seed=3)

    hooks = [[("blocks.1.attn.hook_z", steer)], []]  # prompt 0 only
    ours = parallel.generate(TEXTS, max_new_tokens=6, do_sample=False, prompt_hooks=hooks, return_type="result")
    theirs = single.generate(TEXTS, max_new_tokens=6, do_sample=False, prompt_hooks=hooks, return_type="result")
    assert ours == theirs
    assert_steered_as_one_rank(parallel, single, TEXTS, moved=[0], prompt_hooks=hooks)


def head_shift(z: torch.Tensor, seed: int) -> torch.Tensor:
    """A seeded shift of every head of ``z`` ``[..., head, d]`` (``d``: d_head, or DeepSeek's
    v_head_dim), large: Gemma's scaled embeddings need it."""
    shift = 10 * torch.randn(z.shape[-2:], generator=torch.Generator().manual_seed(seed))
    return shift.to(z.device, z.dtype)


def assert_steered_as_one_rank(parallel, single, prompts, moved, **hooks) -> None:
    """Two ranks' logits under ``hooks`` equal one rank's, and the hooks moved those of the
    prompts ``moved`` (and no other's): a check that holds where a tiny model's greedy tokens do
    not move (Gemma's post-attention norms, a model that repeats a token)."""
    logits = parallel.run_with_hooks(prompts, **hooks)
    torch.testing.assert_close(logits, single.run_with_hooks(prompts, **hooks), rtol=1e-4, atol=1e-4)
    plain = single(prompts)
    for index in range(len(plain)):
        changed = (logits[index] - plain[index]).abs().max().item()
        assert (changed > 1e-2) == (index in moved), (index, changed)


#: A value each rank holds a partial sum of until vLLM's all-reduce, per architecture: the
#: shared experts' output (Qwen2-MoE, Ernie 4.5 MoE, DeepSeek), and a parallel block's attention and MLP
#: outputs, which vLLM adds before one all-reduce (Cohere, Cohere 2, Falcon).
PARTIAL_SUMS = {
    "qwen2_moe": "blocks.1.mlp.hook_shared_out",
    "ernie4_5_moe": "blocks.1.mlp.hook_shared_out",
    "deepseek_v2": "blocks.1.mlp.hook_shared_out",
    "cohere": "blocks.1.hook_attn_out",
    "cohere2": "blocks.1.hook_mlp_out",
    "falcon": "blocks.1.hook_attn_out",
}


def test_editing_a_partial_sum_over_ranks_equals_one_rank(two_ranks, hooked):
    """A partial sum is read whole (summed over the ranks), and an edit's difference is written
    to rank 0's part."""
    arch, parallel = two_ranks
    if arch not in PARTIAL_SUMS:
        pytest.skip(f"{arch} holds no partial sum over ranks")
    single = hooked(arch)
    shift = torch.randn(single.cfg.d_model, generator=torch.Generator().manual_seed(6))

    def steer(value, hook):
        return value * 0.5 + shift.to(value.device)

    hooks = [[(PARTIAL_SUMS[arch], steer)], []]  # prompt 0 only
    options = dict(max_new_tokens=6, do_sample=False, return_type="result", prompt_hooks=hooks)
    ours = parallel.generate(TEXTS, **options)
    assert ours == single.generate(TEXTS, **options)
    assert_steered_as_one_rank(parallel, single, TEXTS, moved=[0], prompt_hooks=hooks)


def test_a_shared_hook_on_the_batch_equals_one_rank(two_ranks, hooked):
    """Equal-length prompts: every rank runs the shared hook once on the batch (it indexes prompt
    1 of it; a per-prompt call would fail), with the split value gathered and written back."""
    arch, parallel = two_ranks
    single = hooked(arch)
    tokens = torch.randint(2, 500, (2, 6), generator=torch.Generator().manual_seed(4))

    def steer_second(z, hook):
        assert z.shape[0] == 2 and hook.requests == (0, 1)
        z[1] += head_shift(z, seed=5)

    hooks = [("blocks.1.attn.hook_z", steer_second)]
    ours = parallel.generate(tokens, max_new_tokens=6, do_sample=False, fwd_hooks=hooks, return_type="result")
    theirs = single.generate(tokens, max_new_tokens=6, do_sample=False, fwd_hooks=hooks, return_type="result")
    assert ours == theirs
    assert_steered_as_one_rank(parallel, single, tokens, moved=[1], fwd_hooks=hooks)


# ---- the compiled engine on two ranks --------------------------------------------------------------
STEERED = ("blocks.1.hook_resid_post", "blocks.0.attn.hook_z", "blocks.1.mlp.hook_post")
#: Qwen3-MoE's layer 1 is a mixture of experts (no mlp.hook_post); its MoE block's output is
#: whole on every rank (vLLM reduces it inside the block), read through hook_mlp_out.
#: Qwen2-MoE's shared expert output is a partial sum on each rank (summed inside the graph).
COMPILED_STEERED = {
    "llama": STEERED, "qwen3": STEERED, "qwen3_moe": STEERED[:2], "qwen2_moe": STEERED[:2],
    "olmo2": STEERED,
}
#: Those the default run compiles on two ranks (each compile takes about a minute here).
COMPILED_SPLIT = {
    "llama": "heads and MLP units split, gathered and written back inside the graph",
    "qwen2_moe": "experts, a shared expert's partial sum summed inside the graph",
}


@pytest.fixture(scope="module", params=sweep(tuple(COMPILED_STEERED), COMPILED_SPLIT))
def compiled_two_ranks(request, hooked, engine_args) -> Iterator[tuple[str, HookedVLLM]]:
    """A compiled engine on two ranks with every name of the model traced into its graph, and
    values split over the ranks (z, the MLP's hidden) among the steered ones."""
    arch = request.param
    names = tuple(name for name in hooked(arch).hook_names if not name.startswith("sampler."))
    with HookedVLLM.from_pretrained(
        tiny_model(arch), dtype="float32", tensor_parallel_size=2, **engine_args,
        compiled_capture=names, compiled_steering=COMPILED_STEERED[arch],
    ) as model:
        yield arch, model


def test_compiled_two_ranks_read_every_name_as_one_eager_rank(compiled_two_ranks, hooked):
    arch, parallel = compiled_two_ranks
    single = hooked(arch)
    logits, cache = parallel.run_with_cache(TEXTS, max_new_tokens=3)
    expected_logits, expected = single.run_with_cache(TEXTS, names_filter=list(cache.keys()),
                                                      max_new_tokens=3)
    assert {n for n in single.hook_names if not n.startswith("sampler.")} <= set(cache.keys())
    # As above (two ranks' all-reduce), plus Inductor's fusion of the traced hooks (≤ 1e-6).
    for name in expected.keys():
        torch.testing.assert_close(cache[name], expected[name], rtol=1e-4, atol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)


def test_compiled_two_ranks_steer_as_one_eager_rank(compiled_two_ranks, hooked):
    """Steering as data on a whole value (the residual) and on values split over the ranks (z,
    projected out of a direction across both ranks' heads; the MLP's hidden, scaled), prompt 0
    only: the tokens of one eager rank, and prompt 1 untouched."""
    from vlens import Steer

    arch, parallel = compiled_two_ranks
    single = hooked(arch)
    generator = torch.Generator().manual_seed(7)
    d_z = single.cfg.n_heads * single.cfg.d_head
    steers = [
        Steer("blocks.1.hook_resid_post", add=torch.randn(single.cfg.d_model, generator=generator),
              scale=3.0, positions=slice(2, None)),
        Steer("blocks.0.attn.hook_z", ablate=torch.randn(d_z, generator=generator)),
        Steer("blocks.1.mlp.hook_post", gain=torch.full((single.cfg.d_mlp,), 1.5)),
    ]
    steers = [steer for steer in steers if steer.name in COMPILED_STEERED[arch]]
    options = dict(max_new_tokens=6, do_sample=False, stop_at_eos=False, return_type="result")
    ours = parallel.generate(TEXTS, prompt_steering=[steers, []], **options)
    theirs = single.generate(TEXTS, prompt_steering=[steers, []], **options)
    plain = single.generate(TEXTS, **options)
    assert ours == theirs
    assert ours[0] != plain[0] and ours[1] == plain[1]


def test_raw_locations_are_refused_under_tensor_parallelism(two_ranks):
    _, parallel = two_ranks
    with pytest.raises(NotImplementedError, match="tensor parallelism"):
        parallel.run_with_cache("x", names_filter="model.layers.0.mlp.act_fn.output")


def test_worker_processes_import_the_runtime_package_alone(engine_args):
    """A spawned worker (as on a GPU, where vLLM never forks) loads vlens's runtime package
    (:mod:`vlens.runtime`) and nothing else of vlens, nor TransformerLens, and
    vLLM's channels are not opened to pickled payloads (``VLLM_ALLOW_INSECURE_SERIALIZATION``
    stays unset in the user's process and in the workers)."""
    import subprocess
    import sys

    script = """
import os, sys
os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
from vlens import HookedVLLM
from vlens.testing.tiny import tiny_model
import json
args = json.loads(os.environ["VLENS_TEST_ENGINE_ARGS"])
model = HookedVLLM.from_pretrained(tiny_model("llama"), dtype="float32", tensor_parallel_size=2, **args)
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
    import json
    import os

    environment = {**os.environ, "VLENS_TEST_ENGINE_ARGS": json.dumps(engine_args)}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=environment
    )
    workers = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("WORKER")]
    assert len(workers) == 2, result.stderr[-3000:]
    assert "INSECURE unset" in result.stdout
    for insecure, *modules in workers:
        assert insecure == "unset"
        assert "vlens.runtime.worker" in modules  # the runtime did run there
        assert not [m for m in modules if m.startswith("transformer_lens")], modules
        # the leaf package alone: nothing of the user's side, the names or the mapping files
        outside = [m for m in modules if m != "vlens" and not m.startswith("vlens.runtime")]
        assert not outside, outside


def memory_blocks_of_children() -> int:
    """How many shared host blocks (:mod:`vlens.runtime.transfer.host_blocks`) this process's children
    (the engines' worker processes) hold open."""
    me, count = str(os.getpid()), 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                parent = stat.read().rsplit(")", 1)[1].split()[1]
            if parent != me:
                continue
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:  # gone meanwhile
            continue
        count += sum("memfd:vlens-kept-rows" in link for link in links)
    return count


def test_compiled_two_ranks_hand_back_the_memory_they_wrote(compiled_two_ranks, mapped_references):
    """The kept rows are written into memory shared with this process as steps end and come back
    as views of it; a cache still held keeps its memory (a later call writes elsewhere), and
    memory let go of is written again rather than more taken."""
    arch, parallel = compiled_two_ranks
    names = list(COMPILED_STEERED[arch])
    _, held = parallel.run_with_cache(TEXTS, names_filter=names, max_new_tokens=3)
    assert {tuple(held[name].shape) for name in names} <= {reference[5] for reference in mapped_references}
    kept = {name: held[name].clone() for name in names}
    _, other = parallel.run_with_cache(TEXTS[::-1], names_filter=names, max_new_tokens=5)
    for name in names:
        torch.testing.assert_close(held[name], kept[name], rtol=0, atol=0)
    del held, other
    gc.collect()
    blocks = []  # open after each call
    for _ in range(5):
        _, again = parallel.run_with_cache(TEXTS, names_filter=names, max_new_tokens=3)
        for name in names:
            torch.testing.assert_close(again[name], kept[name], rtol=0, atol=0)
        del again
        gc.collect()
        blocks.append(memory_blocks_of_children())
    # the second set of blocks (taken while the first was held) is given back after a few calls
    assert blocks == sorted(blocks, reverse=True) and blocks[-1] == blocks[-2] < blocks[0]


ORPHANED_CHILD = r"""
import json, os, sys, time
from vlens import HookedVLLM
from vlens.testing.tiny import tiny_model

args = {"tensor_parallel_size": 2, **json.loads(sys.argv[1])}
model = HookedVLLM.from_pretrained(tiny_model("llama"), dtype="float32", **args)
model.run_with_cache("orphaned workers", names_filter="blocks.0.hook_resid_post")
children = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[1] == str(os.getpid()):
                children.append(int(pid))
    except OSError:
        pass
def announce(value, hook):  # killed while the workers run a step
    if hook.is_prefill is False and announce.once:
        announce.once = False
        # every rank runs the hook: one write each, so that two ranks' lines never interleave
        os.write(1, ("READY " + json.dumps(children) + "\n").encode())
        time.sleep(0.5)
announce.once = True
model.generate(["orphaned workers"] * 8, max_new_tokens=400, do_sample=False, verbose=False,
               fwd_hooks=[("blocks.0.hook_resid_post", announce)])
time.sleep(600)
"""


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_workers_of_a_killed_process_exit_and_leave_no_shared_memory_file(engine_args):
    """SIGKILL the process that holds a two-rank engine (as a ``timeout`` or a crashed notebook
    kernel does): within 10 s its worker processes are gone, and so are vlens's files in
    shared memory."""
    import json
    import signal
    import subprocess
    import sys
    import time

    child = subprocess.Popen(
        [sys.executable, "-c", ORPHANED_CHILD, json.dumps(engine_args)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        ready = next((line for line in child.stdout if line.startswith("READY ")), None)
        assert ready is not None, child.stderr.read()[-3000:]
        workers = json.loads(ready[6:])
        assert len(workers) >= 2, workers  # two ranks' worker processes at least
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        deadline = time.monotonic() + 10
        while any(map(running, workers)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in workers if running(pid)], "workers outlived their parent"
    finally:
        for pid in workers if "workers" in locals() else []:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        child.kill()
    assert not [name for name in os.listdir("/dev/shm") if name.startswith("vlens-")]
