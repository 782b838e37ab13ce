"""vLLM's engine client with each request's ``vlens`` fields honoured.

vLLM's OpenAI handlers turn a request into sampling parameters and call the engine client's
``generate``. The server's routes (:mod:`vlens.serve.routes`) read and plan the ``vlens`` object
and admit the plan here, under a ticket that travels to ``generate`` in ``vllm_xargs`` (a short
string: the object itself, vectors of thousands of numbers, would be written to JSON and read back
for every request). ``generate`` takes the plan by its ticket, tags the request, starts every worker
on it (inside the request where the graph does all it asks, :mod:`vlens.runtime.compiled.inline`; else
with the worker call ``HookedVLLM`` makes), passes it on to vLLM's own client, and when it
finishes fetches what was captured (one call for the requests finishing together,
:mod:`vlens.serve.finishes`) and holds it until the client fetches it (:mod:`vlens.serve.captures`). Requests
without a ticket pass straight through.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.exceptions import EngineDeadError

from vlens.engine.engine import WorkerCall
from vlens.engine.prefix_cache import CacheUse, cache_use, skips_reading
from vlens.runtime.compiled.inline import INLINE_KEY
from vlens.runtime.transfer.messages import TAG_KEY, Handback
from vlens.serve.captures import HeldCaptures
from vlens.serve.finishes import BatchedFinishes
from vlens.serve.model import Planned, ServedModel

#: The ``vllm_xargs`` key that carries a request's ticket (:meth:`VlensEngineClient.admit`).
FIELDS_KEY = "vlens_fields"

_serial = itertools.count()

#: Captures whose response was never written (the client went away) kept at most.
MAX_UNCLAIMED = 4096

#: Tickets kept at most: a streamed response whose body was never sent releases none.
MAX_TICKETS = 65536

#: Seconds the routes have, once the requests left in flight at shutdown are told so, to write
#: their 503s before the engine stops.
ANSWER_SECONDS = 2.0

#: What :meth:`VlensEngineClient.until_stopped` returns where the server stopped first.
STOPPED = object()


@dataclass(frozen=True)
class Captured:
    """What a finished request captured: its id among the held captures and each name's shape."""

    activations: str
    names: dict[str, list[int]]


class VlensEngineClient:
    """Wraps vLLM's engine client: ``generate`` honours the ``vlens`` fields; everything else is
    vLLM's own."""

    def __init__(
        self,
        engine: Any,
        served: ServedModel,
        vectors: Mapping[str, Tensor],
        captures: HeldCaptures,
        steered_models: Mapping[str, dict] | None = None,
    ) -> None:
        self._engine = engine
        self.served = served
        self.vectors = vectors
        self.captures = captures
        #: served model name -> the ``vlens`` object every request to it gets (``--steered-model``)
        self.steered_models = dict(steered_models or {})
        #: engine request id -> what it captured, until its response is written
        self.captured: dict[str, Captured] = {}
        #: ticket -> the plan of an HTTP request being served (its prompts share it)
        self.tickets: dict[str, Planned] = {}
        #: calls of the workers so far, by method
        self.worker_calls: Counter[str] = Counter()
        #: finished requests' hand-backs, one worker call for those ending together
        self.finishes = BatchedFinishes(lambda tags: self._on_workers("finish", tags, "cpu"))
        #: HTTP requests being answered (a streamed one until its last event)
        self.in_flight = 0
        #: set at shutdown: new requests are refused with a 503
        self.stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Future | None = None  # done once the requests left get a 503

    def enter(self) -> None:
        """An HTTP request begins (the routes call it on the server's event loop)."""
        if self._stop is None:
            self._loop = asyncio.get_running_loop()
            self._stop = self._loop.create_future()
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1

    async def until_stopped(self, awaitable: Any) -> Any:
        """``awaitable``'s result, or :data:`STOPPED` where the server stops first (the work is
        cancelled then: vLLM aborts its requests)."""
        task = asyncio.ensure_future(awaitable)
        try:
            await asyncio.wait((task, self._stop), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
        if task.done() and not task.cancelled():
            return task.result()
        await asyncio.gather(task, return_exceptions=True)
        return STOPPED

    def shutdown(self, timeout: float | None = None) -> None:
        """Called by vLLM's server in a thread of its own on SIGTERM or SIGINT: new requests get
        a 503 at once, those in flight may finish for ``timeout`` seconds (``--shutdown-timeout``;
        vLLM's default 0: none may), the rest then get a 503, and the engine stops."""
        self.stopping = True
        deadline = time.monotonic() + (timeout or 0.0)
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_finish, self._stop)
            deadline = time.monotonic() + ANSWER_SECONDS
            while (self.in_flight or self._unfinished()) and time.monotonic() < deadline:
                time.sleep(0.02)
        self._engine.shutdown(**({} if timeout is None else {"timeout": 0}))

    def _unfinished(self) -> int:
        """Requests vLLM's client still follows (an aborted one until its abort is through)."""
        processor = getattr(self._engine, "output_processor", None)
        return processor.get_num_unfinished_requests() if processor is not None else 0

    def admit(self, planned: Planned) -> str:
        """A ticket for ``planned``, valid until :meth:`release`: random, so that no client can
        name another request's plan."""
        ticket = uuid.uuid4().hex
        self.tickets[ticket] = planned
        while len(self.tickets) > MAX_TICKETS:
            self.tickets.pop(next(iter(self.tickets)))
        return ticket

    def release(self, ticket: str) -> None:
        self.tickets.pop(ticket, None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any
    ) -> AsyncGenerator[Any, None]:
        extra = dict(getattr(sampling_params, "extra_args", None) or {})
        ticket = extra.pop(FIELDS_KEY, None)
        posing = {TAG_KEY, INLINE_KEY} & extra.keys()  # the routes refuse them; whatever else
        if posing:  # reaches here must not pose as another request's rows or carry steers
            raise ValueError(f"{sorted(posing)} are reserved by vlens")
        if ticket is None:
            async for output in self._engine.generate(
                prompt, sampling_params, request_id, *args, **kwargs
            ):
                yield output
            return
        planned = self.tickets.get(ticket)
        if planned is None:  # only vlens's routes admit plans
            raise ValueError(
                f"vllm_xargs.{FIELDS_KEY} is not a request vlens admitted; send a vlens object "
                f"to /v1/completions or /v1/chat/completions"
            )
        sampling_params.extra_args = extra
        if sampling_params.n == 1:
            outputs = self._request(prompt, sampling_params, request_id, request_id, planned,
                                    args, kwargs)
        else:
            outputs = self._samples(prompt, sampling_params, request_id, planned, args, kwargs)
        async for output in outputs:
            yield output

    async def _request(
        self, prompt: Any, sampling_params: Any, request_id: str, capture_key: str,
        planned: Planned, args: tuple, kwargs: dict,
    ) -> AsyncGenerator[Any, None]:
        """One engine request under a tag of its own; what it captured kept as
        ``capture_key``."""
        tag = f"serve-{next(_serial)}:0"
        sampling_params.extra_args = {**sampling_params.extra_args, TAG_KEY: tag}
        prompt = with_cache_use(prompt, sampling_params, cache_use(planned.plan))
        if planned.inline is not None:  # the workers take its plan from the request itself
            sampling_params.extra_args[INLINE_KEY] = planned.inline
            if not planned.plan.graph_keep:  # and forget it when it finishes: no call at all
                async for output in self._engine.generate(
                    prompt, sampling_params, request_id, *args, **kwargs
                ):
                    yield output
                return
            prepared: asyncio.Future = asyncio.get_running_loop().create_future()
            prepared.set_result(None)
        else:
            # A client that leaves cancels this task: the workers still finish what they were
            # asked, and forget the request (shielded: the calls go on while it is cancelled).
            prepared = asyncio.ensure_future(self._on_workers("prepare", {tag: planned.plan}))
        deltas = sampling_params.output_kind == RequestOutputKind.DELTA  # streamed: new tokens only
        prompt_tokens: list[int] | None = None
        sampled: list[int] = []
        try:
            await asyncio.shield(prepared)
            async for output in self._engine.generate(
                prompt, sampling_params, request_id, *args, **kwargs
            ):
                if prompt_tokens is None and output.prompt_token_ids is not None:
                    prompt_tokens = list(output.prompt_token_ids)
                new = list(output.outputs[0].token_ids) if output.outputs else []
                if deltas:
                    sampled.extend(new)
                else:
                    sampled = new
                yield output
        finally:
            handback = await asyncio.shield(asyncio.ensure_future(self._forget(prepared, tag)))
        if planned.names and prompt_tokens is not None and handback is not None:
            # Off the event loop: assembling and serialising a capture is tensor work.
            values = await asyncio.to_thread(
                self.served.activations, planned, tag, handback, prompt_tokens, sampled
            )
            key = await asyncio.to_thread(self.captures.put, values)
            shapes = {name: list(value.shape) for name, value in values.items()}
            self.captured[capture_key] = Captured(key, shapes)
            while len(self.captured) > MAX_UNCLAIMED:  # responses that were never written
                self.captured.pop(next(iter(self.captured)))

    async def _samples(
        self, prompt: Any, sampling_params: Any, request_id: str, planned: Planned,
        args: tuple, kwargs: dict,
    ) -> AsyncGenerator[Any, None]:
        """``n`` samples as ``n`` requests of one sample, each tagged (and captured) on its own,
        as vLLM splits them itself (child ``i``: request id ``{i}_{id}``, seed ``seed + i``);
        their outputs merged back into the request's, sample ``i`` at index ``i``. vLLM's own
        split would give every sample the one tag, and the workers one request's rows."""
        count = sampling_params.n
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def sample(index: int) -> None:
            child = copy.copy(sampling_params)
            child.n = 1
            if child.seed is not None:
                child.seed = sampling_params.seed + index
            try:
                async for output in self._request(
                    prompt, child, f"{index}_{request_id}", sample_key(request_id, index, count),
                    planned, args, kwargs,
                ):
                    await queue.put((index, output))
            except BaseException as error:
                await queue.put((index, error))
                raise
            await queue.put((index, None))

        tasks = [asyncio.ensure_future(sample(index)) for index in range(count)]
        final_only = sampling_params.output_kind == RequestOutputKind.FINAL_ONLY
        finals: dict[int, Any] = {}
        running = count
        try:
            while running:
                index, output = await queue.get()
                if isinstance(output, BaseException):
                    raise output
                if output is None:
                    running -= 1
                    continue
                output.request_id = request_id
                for completion in output.outputs:
                    completion.index = index
                if final_only:
                    finals[index] = output
                    continue
                output.finished = output.finished and running == 1
                yield output
            if final_only:
                merged = finals[count - 1]
                merged.outputs = [finals[i].outputs[0] for i in range(count)]
                merged.finished = True
                yield merged
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _forget(self, prepared: asyncio.Future, tag: str) -> Handback | None:
        """The workers' hand-back of request ``tag`` once its preparation is done, and the
        request forgotten there; None where the preparation failed (nothing to forget) or the
        server stopped the engine first."""
        try:
            await prepared
        except Exception:
            return None
        try:
            return await self.finishes.finish(tag)
        except EngineDeadError:
            if self.stopping:  # the shutdown stopped the engine under a request it ended
                return None
            raise

    async def status(self) -> dict[str, Any]:
        """What the server holds now: the HTTP requests it is answering, its held captures,
        captures whose response was never written, admitted plans, and what each worker follows
        (all zero on an idle server, but the unfetched ones); and how many times it called the
        workers, by method."""
        return {
            "in_flight": self.in_flight,
            "captures": self.captures.status(),
            "unclaimed_captures": len(self.captured),
            "tickets": len(self.tickets),
            "worker_calls": dict(self.worker_calls),
            "workers": await self._on_workers("holds"),
        }

    async def _on_workers(self, method: str, *args: Any) -> list[Any]:
        """``WorkerRuntime.<method>(*args)`` on every worker (as ``Engine._on_workers`` does for
        worker processes): one result per rank."""
        self.worker_calls[method] += 1
        with WorkerCall(method, args) as call:
            return call.results(await self._engine.collective_rpc("vlens_call", args=call.arguments))


def _finish(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def sample_key(request_id: str, index: int, count: int) -> str:
    """The key of sample ``index`` of ``count``'s capture: the request id alone for one
    sample."""
    return request_id if count == 1 else f"{request_id}#{index}"


def with_cache_use(prompt: Any, sampling_params: Any, use: CacheUse) -> Any:
    """``prompt`` and ``sampling_params`` set to use the prefix cache as ``use`` says
    (:mod:`vlens.engine.prefix_cache`); a client's own ``cache_salt`` is kept, and combined. A
    request vLLM already keeps from reading the cache (prompt logprobs) stays so."""
    sampling_params.skip_reading_prefix_cache = skips_reading(sampling_params, use)
    if use.salt is None:
        return prompt
    if not isinstance(prompt, dict):
        raise TypeError(
            f"vLLM handed the engine a prompt of type {type(prompt).__name__}, where vlens "
            f"expects a dict it can salt for the prefix cache"
        )
    theirs = prompt.get("cache_salt")
    return {**prompt, "cache_salt": use.salt if theirs is None else f"{theirs}|{use.salt}"}
