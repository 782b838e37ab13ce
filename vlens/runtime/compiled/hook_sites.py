"""Sites where Python hook functions run inside vLLM's compiled graph.

A compiled engine's forward is traced once (torch.compile; on CUDA, replayed from CUDA graphs):
Python hooks added later never run. A site declared for hooks (``compiled_hooks``) gets, before
the trace, a forward hook whose only work is one call of the custom op ``vlens::hook_site`` with
the module call's tensors. The op is opaque to the compiler: it stays in the graph as a call
into Python, made at every step with that step's real tensors, and it is declared to mutate them,
so that what a hook function edits in place is what the rest of the graph computes on. On CUDA
the op is one of the compilation's ``splitting_ops``: vLLM captures the graph's pieces between
such ops as CUDA graphs and runs the op itself eagerly between them (piecewise mode).

Full CUDA graphs (vLLM's decode steps, in its default mode) capture the whole step in one graph;
there the op breaks the capture (:mod:`vlens.runtime.compiled.breaks`), so that a replay calls into
Python at each site some request of the step uses, between captured segments that keep attention
inside them, and launches the segments between two such sites as one graph.

What runs inside is the eager engine's own machinery (:class:`~vlens.runtime.worker.WorkerRuntime`
handling the call as if a torch hook had fired), so hook functions have the eager engine's
semantics exactly. A site no request of the step needs returns at once.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from vlens.runtime.compiled import breaks as graph_breaks
from vlens.runtime.sites.torch_hooks import find_module
from vlens.runtime.vocabulary.locations import Site

#: The op's name, as vLLM's ``splitting_ops`` lists it.
OP = "vlens::hook_site"

#: A site's handler: called with the module call's (args, kwargs, output) rebuilt.
Handler = Callable[[tuple, dict, Any], None]

#: Site number -> its handler (what the op calls), in this process.
_handlers: dict[int, Handler] = {}
#: The site numbers some request being served needs; the op returns at once at any other.
_active: set[int] = set()
_numbers = itertools.count()


def hook_site(tensors: list[Tensor], layout: list[int], keywords: str, site: int) -> None:
    """Run site ``site``'s handler on the call whose tensors are ``tensors``; ``layout`` and
    ``keywords`` say where each was in the call (:func:`flattened`). While a full CUDA graph is
    captured, break it here (:mod:`vlens.runtime.compiled.breaks`): the call is made at every
    replay, on the graph's own buffers, which weak references name without holding them."""
    graph = graph_breaks.current()
    if graph is None:
        _run_site(tensors, layout, keywords, site)
        return
    from vllm.utils.torch_utils import weak_ref_tensor

    buffers = [weak_ref_tensor(tensor) for tensor in tensors]
    graph.add_site(site, lambda: _run_site(buffers, layout, keywords, site))


def _run_site(tensors: list[Tensor], layout: list[int], keywords: str, site: int) -> None:
    if site in _active:
        _handlers[site](*rebuilt(tensors, layout, keywords))


def _no_output(tensors: list[Tensor], layout: list[int], keywords: str, site: int) -> None:
    """The op's meaning to the compiler: no output; the tensors it mutates keep their shapes."""
    return None


# Defined through ``torch.library.Library`` rather than ``torch.library.custom_op``: both give
# the compiler the same schema, but the latter wraps every eager call in Python checks that cost
# ~6 times the call itself (45 against 7 us on this CPU), paid at every declared site of every
# step in which some site is active.
_library = torch.library.Library(OP.split("::")[0], "DEF")
_library.define(
    f"{OP.split('::')[1]}(Tensor(a!)[] tensors, int[] layout, str keywords, int site) -> ()"
)
_library.impl(OP.split("::")[1], hook_site, "CompositeExplicitAutograd")
torch.library.register_fake(OP, _no_output, lib=_library)


def call_site(read: list[Tensor], written: list[Tensor], layout: list[int], keywords: str,
              site: int) -> None:
    """:func:`hook_site` for a site given a module call's arguments too (a ``call`` site): the
    arguments are only read there (vLLM's q, k and v are views of one tensor, which the
    compiler does not take as mutated inputs of one op), the output may be written."""
    hook_site([*read, *written], layout, keywords, site)


def _no_call_output(read: list[Tensor], written: list[Tensor], layout: list[int], keywords: str,
                    site: int) -> None:
    return None


#: The op of ``call`` sites, beside :data:`OP` among the splitting ops.
CALL_OP = f"{OP.split('::')[0]}::call_site"
_library.define("call_site(Tensor[] read, Tensor(a!)[] written, int[] layout, str keywords, "
                "int site) -> ()")
_library.impl("call_site", call_site, "CompositeExplicitAutograd")
torch.library.register_fake(CALL_OP, _no_call_output, lib=_library)


def active_sites() -> set[int]:
    """The live set of active site numbers (read by the graphs that break at the sites)."""
    return _active


def activate(numbers: Iterable[int], active: bool) -> None:
    """Let the op run (``active``) or skip the handlers of these sites."""
    if active:
        _active.update(numbers)
    else:
        _active.difference_update(numbers)


def number_sites_from(first: int) -> None:
    """Number the sites installed from now on ``first``, ``first + 1``, ...: an engine's own
    block, so that its compiled graph (whose op calls carry the numbers as constants) is the
    same in any process that builds that engine first (:mod:`vlens.runtime.compiled.workers`)."""
    global _numbers
    _numbers = itertools.count(first)


def install_hook_site(model: nn.Module, site: Site, handler: Handler) -> int:
    """Call the op at ``site`` of ``model``, after the hooks already there (torch.compile, on
    some versions, traces a module's hooks in the order they were added, not the order they
    run); the site's number, by which it is activated. Inactive until :func:`activate`."""
    number = next(_numbers)
    _handlers[number] = handler
    module = find_module(model, site.path)

    if site.event == "input":
        module.register_forward_pre_hook(OpCall(number, False), with_kwargs=True)
    elif site.event == "call":
        module.register_forward_hook(CallOpCall(number), with_kwargs=True)
    else:
        module.register_forward_hook(OpCall(number, True), with_kwargs=True)
    return number


class OpCall:
    """The torch hook at a hook site: one call of the registered op (not the Python wrapper
    above) with the call's tensors and the site's number, a constant of the traced graph. The
    readers of an output site read the output alone: the call's arguments stay out of the op,
    whose tensors the compiler must keep alive until it runs (vLLM's fused norms reuse their
    inputs' memory once nothing reads them later)."""

    def __init__(self, number: int, after: bool) -> None:
        self.number = number
        self.after = after  # a forward hook (the output), else a forward pre-hook (the arguments)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: Any = None) -> None:
        if self.after:
            torch.ops.vlens.hook_site(*flattened((), {}, output), self.number)
        else:
            torch.ops.vlens.hook_site(*flattened(args, kwargs, None), self.number)


class CallOpCall:
    """The torch hook at a ``call`` site: one call of :data:`CALL_OP` with the call's arguments
    (read) and its output's tensors (written)."""

    def __init__(self, number: int) -> None:
        self.number = number

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        tensors, layout, keywords = flattened(args, kwargs, output)
        outputs = flattened((), {}, output)[0]
        written = [any(tensor is out for out in outputs) for tensor in tensors]
        # the read tensors first, then the written ones; the layout's slots follow them
        order = [i for i in range(len(tensors)) if not written[i]]
        order += [i for i in range(len(tensors)) if written[i]]
        slots = [-1 if slot < 0 else order.index(slot) for slot in layout[3:]]
        read = [tensors[i] for i in order if not written[i]]
        torch.ops.vlens.call_site(read, [tensors[i] for i in order if written[i]],
                                  [*layout[:3], *slots], keywords, self.number)


def flattened(args: tuple, kwargs: dict, output: Any) -> tuple[list[Tensor], list[int], str]:
    """A module call's tensors, each once, and where they were: ``layout`` is the counts of
    positional arguments, keyword arguments and output elements (-1: a single tensor output),
    then for each of them its tensor's index in ``tensors`` (-1: not a tensor); ``keywords``
    the keyword arguments' names, comma-separated. Computed while the graph is traced: the op's
    layout and keywords are constants of the graph."""
    tensors: list[Tensor] = []

    def index(value: Any) -> int:
        if not isinstance(value, Tensor):
            return -1
        for number, seen in enumerate(tensors):
            if seen is value:
                return number
        tensors.append(value)
        return len(tensors) - 1

    names = sorted(kwargs)
    single = output is not None and not isinstance(output, tuple)
    outputs = (output,) if single else (output or ())
    counts = [len(args), len(names), -1 if single else len(outputs)]
    slots = [index(value) for value in (*args, *(kwargs[name] for name in names), *outputs)]
    return tensors, counts + slots, ",".join(names)


def rebuilt(tensors: list[Tensor], layout: list[int], keywords: str) -> tuple[tuple, dict, Any]:
    """The inverse of :func:`flattened`: ``(args, kwargs, output)``, None where a value was not a
    tensor."""
    n_args, n_kwargs, n_outputs = layout[:3]
    values = [None if slot < 0 else tensors[slot] for slot in layout[3:]]
    args = tuple(values[:n_args])
    names = keywords.split(",") if keywords else []
    kwargs = dict(zip(names, values[n_args : n_args + n_kwargs]))
    outputs = values[n_args + n_kwargs :]
    if n_outputs == -1:
        return args, kwargs, outputs[0]
    return args, kwargs, tuple(outputs) if outputs else None
