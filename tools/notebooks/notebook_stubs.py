"""Stand-ins for everything a notebook draws or displays, so its cells run headless.

plotly, circuitsvis and IPython are replaced in ``sys.modules`` by modules whose every attribute
is a :class:`Sink`: an object that accepts any call, attribute, index or operator and answers
with another sink. A figure built from a tensor still converts the tensor first (the notebooks'
``imshow``/``line``/``scatter`` helpers call ``utils.to_numpy`` before plotting), so a wrong
shape or a non-tensor still fails the cell; only the drawing is gone. matplotlib, when present,
keeps working on the non-interactive Agg backend with ``show`` doing nothing.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

#: Modules replaced outright (each with its submodules listed, so ``from x.y import z`` works).
STUBBED_MODULES = (
    "plotly",
    "plotly.express",
    "plotly.io",
    "plotly.graph_objects",
    "plotly.graph_objs",
    "plotly.subplots",
    "circuitsvis",
    "circuitsvis.attention",
    "circuitsvis.tokens",
    "circuitsvis.activations",
    "circuitsvis.topk_tokens",
    "circuitsvis.topk_samples",
    "circuitsvis.examples",
    "circuitsvis.utils",
    "circuitsvis.utils.render",
    "IPython",
    "IPython.display",
    "IPython.core",
    "IPython.core.display",
    "ipywidgets",
)


class Sink:
    """Anything a plotting or display call may return: every use of it gives another sink."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Sink:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Sink()

    def __call__(self, *args: Any, **kwargs: Any) -> Sink:
        return Sink()

    def __getitem__(self, key: Any) -> Sink:
        return Sink()

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def __setattr__(self, name: str, value: Any) -> None:
        pass

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __bool__(self) -> bool:
        return False

    def __contains__(self, item: Any) -> bool:
        return False

    def __add__(self, other: Any) -> Any:
        return other if isinstance(other, str) else Sink()

    def __radd__(self, other: Any) -> Any:
        return other if isinstance(other, str) else Sink()

    def __str__(self) -> str:
        return ""

    def __repr__(self) -> str:
        return "<stubbed display>"

    def show_code(self) -> str:
        """circuitsvis's ``RenderedHTML.show_code``: the HTML as a string."""
        return ""


class SinkModule(types.ModuleType):
    """A module whose every attribute is a sink (or a submodule registered beside it)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Sink()


class _ExtensionManager:
    def __init__(self) -> None:
        self.loaded: set[str] = set()

    def load_extension(self, name: str) -> None:
        self.loaded.add(name)

    load = load_extension


class _Shell:
    """What ``get_ipython()`` returns: enough for the notebooks' autoreload setup."""

    def __init__(self) -> None:
        self.extension_manager = _ExtensionManager()

    def run_line_magic(self, *args: Any, **kwargs: Any) -> None:
        pass

    def magic(self, *args: Any, **kwargs: Any) -> None:
        pass

    def system(self, *args: Any, **kwargs: Any) -> None:
        pass


_SHELL = _Shell()


def get_ipython() -> _Shell:
    return _SHELL


def display(*objects: Any, **kwargs: Any) -> None:
    """IPython's ``display``: evaluates nothing further, shows nothing."""


def _module(name: str) -> types.ModuleType:
    module = SinkModule(name)
    module.__path__ = []  # a package, so submodules import
    return module


def install() -> dict[str, Any]:
    """Put the stub modules in ``sys.modules`` and return the names a notebook namespace gets
    besides (IPython's builtins ``display`` and ``get_ipython``)."""
    for name in STUBBED_MODULES:
        sys.modules[name] = _module(name)
    for name in STUBBED_MODULES:
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, sys.modules[name])
    ipython = sys.modules["IPython"]
    ipython.get_ipython = get_ipython
    ipython.display = sys.modules["IPython.display"]
    sys.modules["IPython.display"].display = display
    sys.modules["IPython.core.display"].display = display
    _quiet_matplotlib()
    return {"display": display, "get_ipython": get_ipython}


def _quiet_matplotlib() -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.show = lambda *args, **kwargs: None
