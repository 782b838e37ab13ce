"""The workers' hand-back of finished served requests, one call for many requests.

A served request that captured names ends with the workers handing back its rows and forgetting
it (``WorkerRuntime.finish``), one call of every worker. At a few hundred requests a second,
one call per request busies the API process's event loop and puts a utility call between the
engine's steps for each. Here a request that ends while a hand-back call is in flight waits for
the next call, which takes every request that ended meanwhile: under load, one call per batch of
finishing requests; alone, one call at once, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from vlens.runtime.transfer.messages import Handback

#: Hands back the requests of these tags (one result per rank), and forgets them.
FinishCall = Callable[[list[str]], Awaitable[Sequence[Handback]]]


class BatchedFinishes:
    """Each request's :class:`Handback`, from calls that finish every request waiting."""

    def __init__(self, call: FinishCall) -> None:
        self._call = call
        self._waiting: dict[str, asyncio.Future[Handback]] = {}
        self._calling = False

    async def finish(self, tag: str) -> Handback:
        """Request ``tag``'s hand-back (its own rows, as :meth:`Handback.of_request` gives).
        The exception of the call that took it, if that call failed."""
        future: asyncio.Future[Handback] = asyncio.get_running_loop().create_future()
        self._waiting[tag] = future
        if not self._calling:
            self._calling = True
            asyncio.ensure_future(self._drain())
        return await future

    async def _drain(self) -> None:
        """Calls until no request waits: each call takes every request waiting when it starts."""
        try:
            while self._waiting:
                batch, self._waiting = self._waiting, {}
                tags = list(batch)
                try:
                    handback = Handback.of_ranks(await self._call(tags))
                except BaseException as error:  # every request of the call learns why
                    for future in batch.values():
                        if not future.done():
                            future.set_exception(error)
                    if not isinstance(error, Exception):  # cancelled: so are those waiting
                        for future in self._waiting.values():
                            future.cancel()
                        self._waiting.clear()
                        raise
                    continue
                for index, tag in enumerate(tags):
                    if not batch[tag].done():  # its waiter may have been cancelled
                        batch[tag].set_result(handback.of_request(tag, index))
        finally:
            self._calling = False
