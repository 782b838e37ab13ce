"""Operations of a forward's source (:mod:`vlens.runtime.sites.source`) on a module of its own: named
in the order they run, routed only while a site is installed, refused inside loops."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vlens.runtime.sites.source import install_operation_site, operations


class Doubler(nn.Module):
    def forward(self, x):
        return x * 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 6)
        self.doubler = Doubler()

    def forward(self, x, scale: float = 1.0):
        y = self.proj(x)
        a, b = y.split([2, 4], dim=-1)
        a = self.doubler(a) * scale
        for _ in range(2):
            b = b + torch.ones_like(b)
        return torch.cat([a, self.doubler(b)], dim=-1)


def test_operations_are_named_by_what_they_call_in_the_order_they_run():
    listed = operations(Block())
    assert [op.name for op in listed] == [
        "self_proj_0", "y_split_0", "self_doubler_0", "range_0", "torch_ones_like_0",
        "self_doubler_1", "torch_cat_0",
    ]  # the argument self.doubler(b) runs before the torch.cat that takes it
    assert [op.name for op in listed if op.repeated] == ["range_0", "torch_ones_like_0"]
    assert listed[1].text == "a, b = y.split([2, 4], dim=-1)"


@torch.no_grad()
def test_a_site_sees_and_edits_one_call_and_leaves_the_forward_when_removed():
    block, x = Block(), torch.randn(3, 4)
    plain = block(x, scale=3.0)
    seen = []

    def zero_a(args, kwargs, output):
        seen.append(args)
        output[0].zero_()

    handle = install_operation_site(block, "block", "y_split_0", True, zero_a)
    edited = block(x, scale=3.0)
    assert len(seen) == 1 and seen[0] == ([2, 4],)
    assert torch.all(edited[:, :2] == 0) and torch.equal(edited[:, 2:], plain[:, 2:])
    handle.remove()
    assert "forward" not in block.__dict__
    assert torch.equal(block(x, scale=3.0), plain)


def test_operations_in_a_loop_or_not_in_the_forward_are_refused_with_the_offered_ones():
    with pytest.raises(LookupError, match="inside a loop"):
        install_operation_site(Block(), "block", "torch_ones_like_0", True, print)
    with pytest.raises(LookupError, match="Did you mean: y_split_0"):
        install_operation_site(Block(), "block", "y_splt_0", True, print)
