"""A request that vLLM preempts (its KV cache full) and recomputes from its start: its new rows
replace the earlier ones, so the cache holds every position exactly once, as when nothing was
preempted; hooks and steering stay on their positions.

A small KV cache forces preemption: ten blocks of 32 tokens, and prompts just short of a block
boundary, so that decoding makes them all claim a new block at once. Each prompt run alone on the
same engine fits and is the reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from vlens import HookedVLLM
from vlens.hooked.cache import VLensCache
from vlens.runtime.steps.kept_steps import KeptSteps, Segment, add_chunk
from vlens.runtime.steps.layout import RequestRows, mark_sampling
from vlens.runtime.transfer.messages import TAG_KEY, Chunk
from vlens.runtime.vocabulary.steering import Steer

# vLLM refuses a model length whose one request would not fit the 320 cached tokens
PREEMPTING = dict(
    block_size=32, num_gpu_blocks_override=10, max_num_batched_tokens=64, max_num_seqs=8,
    max_model_len=256,
)
LENGTHS = (31, 63, 30, 29, 62, 28, 31, 60, 3, 45)
PROMPTS = [
    torch.randint(3, 500, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    for length in LENGTHS
]
NEW_TOKENS = 20
TOLERANCE = 1e-5


class Preemptions:
    """The prompts (their index in the call) that vLLM's scheduler preempted, in order, since
    :meth:`counting` began: counted where the scheduler preempts, since vLLM's Prometheus counter
    (``LLM.get_metrics()``, ``vllm:num_preemptions``) is process-wide and reports the engine
    built last."""

    def __init__(self) -> None:
        self.prompts: list[int] = []

    @contextmanager
    def counting(self, model: HookedVLLM) -> Iterator[Preemptions]:
        scheduler = model.engine.llm.llm_engine.engine_core.engine_core.scheduler
        preempt = scheduler._preempt_request

        def counted(request, *args, **kwargs):
            tag = request.sampling_params.extra_args[TAG_KEY]
            self.prompts.append(int(tag.split(":")[1]))
            return preempt(request, *args, **kwargs)

        scheduler._preempt_request = counted
        try:
            yield self
        finally:
            del scheduler._preempt_request  # the class's method again


@pytest.fixture(scope="module")
def eager(hooked) -> Iterator[tuple[HookedVLLM, Preemptions]]:
    model = hooked("qwen3", **PREEMPTING)
    with Preemptions().counting(model) as preemptions:
        yield model, preemptions


STEERED = "blocks.1.hook_resid_post"


@pytest.fixture(scope="module")
def compiled(hooked) -> Iterator[tuple[HookedVLLM, Preemptions]]:
    """Every name that the graph can hold (the sampler's are read outside it), and a steer."""
    model = hooked(
        "qwen3",
        compiled_capture=lambda name: not name.startswith("sampler."),
        compiled_steering=(STEERED,),
        **PREEMPTING,
    )
    with Preemptions().counting(model) as preemptions:
        yield model, preemptions


def run_preempted(
    model: HookedVLLM, preemptions: Preemptions, **kwargs
) -> tuple[VLensCache, list[VLensCache], set[int]]:
    """The prompts' cache with every name, run together; each prompt's cache run alone
    (asserting nothing was preempted); and which prompts vLLM preempted when run together
    (asserted to be some). ``kwargs`` (``prompt_hooks``, ``prompt_steering``) hold one entry
    per prompt."""
    before = len(preemptions.prompts)
    _, together = model.run_with_cache(PROMPTS, max_new_tokens=NEW_TOKENS, **kwargs)
    preempted = set(preemptions.prompts[before:])
    assert preempted, "nothing was preempted: the test proves nothing"
    before = len(preemptions.prompts)
    alone = []
    for index, prompt in enumerate(PROMPTS):
        own = {key: [value[index]] for key, value in kwargs.items()}
        alone.append(model.run_with_cache([prompt], max_new_tokens=NEW_TOKENS, **own)[1])
    assert len(preemptions.prompts) == before, "a prompt alone was preempted: no clean reference"
    return together, alone, preempted


def assert_every_position_as_alone(together, alone: list) -> None:
    """Every name at every position (prompt and generated) of every prompt, as run alone."""
    assert sorted(together.keys()) == sorted(alone[0].keys())
    for index, reference in enumerate(alone):
        length = int(reference.lengths[0])
        assert int(together.lengths[index]) == length
        assert together.tokens[index, :length].tolist() == reference.tokens[0].tolist()
        for name in reference.keys():
            torch.testing.assert_close(
                together.unpadded(name, index), reference.unpadded(name, 0), rtol=0,
                atol=TOLERANCE, msg=lambda text, name=name, i=index: f"{name}, prompt {i}: {text}",
            )


def test_every_name_under_preemption_equals_each_prompt_alone(eager):
    together, alone, _ = run_preempted(*eager)
    assert len(together.keys()) > 50
    assert_every_position_as_alone(together, alone)


def test_hooks_under_preemption_edit_and_read_as_alone(eager):
    """An editing hook runs again on the recomputed rows: the cache (which shows its edit) and
    the tokens it steers are those of each prompt alone. A hook on the pattern makes vlens
    compute that layer's attention itself, from its own key history of the request."""
    model, preemptions = eager
    vector = 4 * torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(1))

    def push(resid: torch.Tensor, hook) -> torch.Tensor:
        return resid + vector.to(resid.device, resid.dtype)

    def sharpen(pattern: torch.Tensor, hook) -> torch.Tensor:
        pattern = pattern**2
        return pattern / pattern.sum(-1, keepdim=True)

    hooks = [("blocks.0.hook_resid_post", push), ("blocks.1.attn.hook_pattern", sharpen)]
    hooked_prompts = [hooks if index % 2 == 0 else [] for index in range(len(PROMPTS))]
    together, alone, preempted = run_preempted(model, preemptions, prompt_hooks=hooked_prompts)
    assert_every_position_as_alone(together, alone)
    chosen = sorted(index for index in preempted if hooked_prompts[index])
    assert chosen, "no hooked prompt was preempted: the test proves nothing"
    index = chosen[0]
    _, plain = model.run_with_cache(PROMPTS[index], max_new_tokens=NEW_TOKENS, names_filter=[])
    length = int(together.lengths[index])
    assert plain.tokens[0].tolist() != together.tokens[index, :length].tolist(), (
        "the hooks changed no token of a preempted prompt: the test proves nothing"
    )


def test_compiled_graph_under_preemption_equals_each_prompt_alone(compiled):
    model, preemptions = compiled
    vector = 6 * torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(2))
    steers = [
        [Steer(STEERED, add=vector, positions=slice(20, None))] if index % 3 == 1 else []
        for index in range(len(PROMPTS))
    ]
    together, alone, preempted = run_preempted(model, preemptions, prompt_steering=steers)
    assert len(together.keys()) > 50
    assert_every_position_as_alone(together, alone)
    chosen = sorted(index for index in preempted if steers[index])
    assert chosen, "no steered prompt was preempted: the test proves nothing"
    _, plain = model.run_with_cache(PROMPTS[chosen[0]], max_new_tokens=NEW_TOKENS)
    steered, unsteered = together.unpadded(STEERED, chosen[0]), plain.unpadded(STEERED, 0)
    torch.testing.assert_close(steered[:20], unsteered[:20], rtol=0, atol=TOLERANCE)
    assert not torch.allclose(steered[20:21], unsteered[20:21]), "the steer changed nothing"


# ---- the bookkeeping, step by step ------------------------------------------------------------


def rows(*values: float) -> torch.Tensor:
    return torch.tensor(values).reshape(-1, 1)


def test_whole_step_rows_of_a_recomputed_request_replace_its_earlier_rows():
    """``a`` runs positions 0..3, is preempted, and is recomputed in two chunks then decoded;
    ``b`` runs on. Each position of ``a`` holds its latest row, once."""
    store = KeptSteps()
    store.add("x", [Segment("a", 3, 0), Segment("b", 2, 0)], rows(0, 1, 2, 20, 21))
    store.add("x", [Segment("a", 1, 3), Segment("b", 1, 2)], rows(3, 22))
    store.add("x", [Segment("b", 1, 3), Segment("a", 2, 0)], rows(23, 10, 11))
    store.add("x", [Segment("a", 2, 2)], rows(12, 13))
    store.add("x", [Segment("a", 1, 4), Segment("b", 1, 4)], rows(14, 24))
    taken = store.take(["a", "b"], {"a": frozenset({"x"}), "b": frozenset({"x"})}, "cpu")["x"]
    assert taken.values.squeeze(-1).tolist() == [[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]]
    assert taken.spans == [[(0, 5)], [(0, 5)]]
    assert taken.is_batch([5, 5])


def test_a_recomputed_request_replaces_its_chunks_from_where_it_restarts():
    chunks: list[Chunk] = []
    for first, values in ((0, rows(0, 1, 2)), (3, rows(3)), (4, rows(4)), (0, rows(10, 11))):
        add_chunk(chunks, Chunk(first, values))
    add_chunk(chunks, Chunk(2, rows(12, 13, 14)))
    assert [(c.first_position, c.value.squeeze(-1).tolist()) for c in chunks] == [
        (0, [10, 11]), (2, [12, 13, 14])
    ]
    add_chunk(chunks, Chunk(7, rows(17)))  # a gap stays a gap
    add_chunk(chunks, Chunk(3, rows(23)))  # a restart inside a chunk keeps the rows before it
    assert [(c.first_position, c.value.squeeze(-1).tolist()) for c in chunks] == [
        (0, [10, 11]), (2, [12]), (3, [23])
    ]


def test_a_recomputed_request_samples_only_once_back_where_it_stopped():
    """A 5-token prompt prefilled in two chunks (sampling token 0), decoded twice (positions 5
    and 6, sampling tokens 1 and 2), preempted, then recomputed over its 8 known tokens in
    chunks of 6 and 2 (vLLM discards what it samples after the first), and decoded on."""
    furthest: dict[str, int] = {}
    sampled: list[int | None] = []

    def step(first: int, count: int) -> None:
        layout = [RequestRows("t", 0, count, first, 5, 0)]
        mark_sampling(layout, furthest)
        row = layout[0].sampled_row()
        sampled.append(None if row is None else row.first_position)

    for first, count in ((0, 3), (3, 2), (5, 1), (6, 1), (0, 6), (6, 2), (8, 1)):
        step(first, count)
    assert sampled == [None, 0, 1, 2, None, 3, 4]
