"""``Steer``: steering as data, and its eager form (a hook function)."""

from __future__ import annotations

import pytest
import torch

from vlens.runtime.vocabulary.steering import Steer, steered


@pytest.mark.parametrize(
    ("positions", "first", "count", "expected"),
    [
        (None, 4, 3, [0, 1, 2]),
        (slice(2, None), 0, 5, [2, 3, 4]),
        (slice(2, None), 7, 1, [0]),
        (slice(5, None, 2), 0, 10, [5, 7, 9]),
        (slice(5, None, 2), 6, 1, []),
        (slice(5, None, 2), 7, 1, [0]),
        (slice(None, 3), 2, 4, [0]),
        ([1, 4, 9], 0, 5, [1, 4]),
        ([1, 4, 9], 9, 1, [0]),
    ],
)
def test_offsets_pick_the_chosen_positions(positions, first, count, expected):
    steer = Steer("blocks.0.hook_resid_post", add=torch.ones(4), positions=positions)
    assert list(steer.offsets(first, count)) == expected


def test_terms_and_their_effect():
    direction = torch.tensor([3.0, 4.0])
    steer = Steer("x", add=torch.tensor([1.0, 0.0]), scale=2.0, ablate=direction, gain=0.5)
    add, gain, ablate = steer.terms(2)
    torch.testing.assert_close(ablate, direction / 5)
    value = torch.tensor([[3.0, 4.0], [4.0, -3.0]])
    # The first row lies along the ablated direction: only 0.5·0 + 2·add is left.
    expected = torch.tensor([[2.0, 0.0], [4.0, -1.5]])
    torch.testing.assert_close(steered(value, add, gain, ablate), expected)
    neutral = [torch.zeros(2), torch.ones(2), torch.zeros(2)]
    assert torch.equal(steered(value, *neutral), value)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({}, "changes nothing"),
        ({"add": torch.ones(2), "positions": [-1]}, "negative positions"),
        ({"add": torch.ones(2), "positions": slice(-3, None)}, "count forward"),
    ],
)
def test_bad_steers_are_refused(arguments, message):
    with pytest.raises(ValueError, match=message):
        Steer("x", **arguments)


def test_a_zero_ablation_direction_is_refused():
    with pytest.raises(ValueError, match="ablate direction is zero"):
        Steer("x", ablate=torch.zeros(2)).terms(2)


def test_eager_steer_equals_the_same_hook_function(hooked):
    model = hooked("qwen3")
    vector = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(3)) * 4
    name = "blocks.1.hook_resid_post"

    def add_from_position_two(x, hook):
        x[hook.positions >= 2] += vector.to(x.device)  # [batch, pos], where x is

    prompts = [[4, 8, 15, 16, 23], [42, 7]]
    options = {"max_new_tokens": 6, "do_sample": False, "stop_at_eos": False,
               "return_type": "input"}
    steer = Steer(name, add=vector, positions=slice(2, None))
    by_data = model.generate(prompts, steering=[steer], **options)
    by_hook = model.generate(prompts, fwd_hooks=[(name, add_from_position_two)], **options)
    assert by_data == by_hook
    with pytest.raises(ValueError, match="two steers of"):
        model.generate(prompts, steering=[steer], prompt_steering=[[Steer(name, gain=2.0)], []])


def test_names_that_cannot_be_written_are_refused_before_running(hooked):
    model = hooked("qwen3")
    with pytest.raises(ValueError, match="cannot be steered"):
        model.generate([[1, 2, 3]], steering=[Steer("blocks.0.ln1.hook_scale", gain=2.0)])
