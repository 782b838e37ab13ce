"""Prompts for the example: paragraphs of the Python standard library's own docstrings (English
prose on many topics, on every machine, no download), one JSON line each, as ``vlens cache``
reads them.

    python docs/examples/sae_smollm2/prompts.py > prompts.jsonl
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import pkgutil
import sys
import warnings

MIN_CHARACTERS = 300  # about 64 of SmolLM2's tokens, the contexts' length
#: modules that act when imported (print, open a browser) or hold only tests
SKIPPED = {"this", "antigravity", "idlelib", "test", "turtledemo"}


def paragraphs() -> list[str]:
    found: set[str] = set()
    warnings.simplefilter("ignore")
    for module_info in sorted(pkgutil.iter_modules(), key=lambda m: m.name):
        name = module_info.name
        if name not in sys.stdlib_module_names or name in SKIPPED or name.startswith("_"):
            continue
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                module = importlib.import_module(name)
        except Exception:  # a module this machine cannot import (a GUI toolkit, say)
            continue
        members = [module, *(value for _, value in inspect.getmembers(module))]
        members += [value for cls in members if inspect.isclass(cls)
                    for _, value in inspect.getmembers(cls)]
        for member in members:
            for paragraph in (inspect.getdoc(member) or "").split("\n\n"):
                text = " ".join(paragraph.split())
                if len(text) >= MIN_CHARACTERS and text.isascii() and ">>>" not in text:
                    found.add(text)
    return sorted(found)


if __name__ == "__main__":
    for text in paragraphs():
        print(json.dumps({"text": text}))
