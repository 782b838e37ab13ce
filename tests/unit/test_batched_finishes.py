"""The server's hand-backs: requests that end while a call is in flight share the next call,
and each gets its own rows."""

import asyncio

import pytest
import torch

from vlens.runtime.transfer.messages import Handback, PaddedRows, RequestCapture
from vlens.serve.finishes import BatchedFinishes


class Workers:
    """Stands in for the workers' ``finish``: request ``t``'s row holds ``t``'s number; each
    call waits until released."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.release = asyncio.Event()
        self.fail: Exception | None = None

    async def finish(self, tags: list[str]) -> list[Handback]:
        self.calls.append(tags)
        await self.release.wait()
        self.release.clear()
        if self.fail is not None:
            raise self.fail
        values = torch.tensor([[float(tag[1:])] * 3 for tag in tags]).unsqueeze(-1)
        rows = PaddedRows(values, [[(0, 3)] for _ in tags])
        return [Handback({tag: RequestCapture() for tag in tags}, {"name": rows})]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_requests_ending_during_a_call_share_the_next_one():
    async def scenario():
        workers = Workers()
        finishes = BatchedFinishes(workers.finish)
        first = asyncio.ensure_future(finishes.finish("t1"))
        await settle()
        later = [asyncio.ensure_future(finishes.finish(tag)) for tag in ("t2", "t3", "t4")]
        await settle()
        assert workers.calls == [["t1"]]  # the others wait for the call in flight
        workers.release.set()
        await settle()
        assert workers.calls == [["t1"], ["t2", "t3", "t4"]]
        workers.release.set()
        handbacks = [await first, *[await task for task in later]]
        for number, handback in enumerate(handbacks, start=1):
            assert list(handback.captures) == [f"t{number}"]
            rows = handback.padded["name"]
            assert rows.values.shape == (1, 3, 1) and rows.spans == [[(0, 3)]]
            assert rows.values.eq(number).all()

    asyncio.run(scenario())


def test_a_failed_call_fails_its_requests_and_the_next_call_runs():
    async def scenario():
        workers = Workers()
        finishes = BatchedFinishes(workers.finish)
        workers.fail = RuntimeError("engine stopped")
        failing = [asyncio.ensure_future(finishes.finish(tag)) for tag in ("t1", "t2")]
        await settle()
        workers.release.set()
        for task in failing:
            with pytest.raises(RuntimeError, match="engine stopped"):
                await task
        workers.fail = None
        later = asyncio.ensure_future(finishes.finish("t5"))
        await settle()
        workers.release.set()
        assert (await later).padded["name"].values.eq(5).all()
        assert workers.calls == [["t1", "t2"], ["t5"]]

    asyncio.run(scenario())
