"""The values a notebook's cells bind, recorded on one backend and compared with another's.

After each cell a recording runner keeps the floating tensors and numbers the cell bound (a
strided subsample of at most :data:`KEPT` values each); two records of the same notebook are
compared name by name as ``max|ours - theirs| / max|theirs|``, and written as a table.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import Any

import notebook_stubs
from notebook_cells import Cell, Notebook
from run_notebook import CellResult, Runner, counts, environment

#: Values kept per recorded tensor (a strided subsample of larger ones).
KEPT = 100_000

#: cell index -> name -> (the value's shape, its kept values)
Record = dict[int, dict[str, tuple[tuple[int, ...], Any]]]


def bound_values(cell: Cell, namespace: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], Any]]:
    """The floating tensors and the numbers ``cell`` bound, as float64 on the CPU."""
    import torch

    kept = {}
    for name in sorted(cell.bound):
        value = namespace.get(name)
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            flat = value.detach().flatten().cpu()
            step = max(1, flat.numel() // KEPT)
            kept[name] = (tuple(value.shape), flat[::step][:KEPT].double().clone())
        elif isinstance(value, float | int) and not isinstance(value, bool):
            kept[name] = ((), torch.tensor([float(value)], dtype=torch.float64))
    return kept


class Recording(Runner):
    """:class:`run_notebook.Runner` that records what each cell binds in ``values``."""

    def __init__(self, notebook: Notebook, backend: str, path: Path, timeout: float) -> None:
        super().__init__(notebook, backend, path, timeout, stop_in_cell=False)
        # ray (imported by vLLM here) registers callbacks on IPython's events when it sees IPython
        notebook_stubs.get_ipython().events = notebook_stubs.Sink()  # type: ignore[attr-defined]
        self.values: Record = {}

    def run_cell(self, cell: Cell) -> CellResult:
        result = super().run_cell(cell)
        self.values[cell.index] = bound_values(cell, self.namespace)
        return result


def compare(ours: Record, theirs: Record, label: str) -> list[dict]:
    """Per cell and name recorded on both: shapes, and ``max|a-b| / max|b|`` where they match
    (``label``: the other backend's name, for the notes)."""
    rows = []
    for index in sorted(set(ours) & set(theirs)):
        for name in sorted(set(ours[index]) & set(theirs[index])):
            (shape, a), (their_shape, b) = ours[index][name], theirs[index][name]
            row: dict[str, Any] = {"cell": index, "name": name, "shape": list(shape)}
            if shape != their_shape or a.shape != b.shape:
                row["relative_difference"] = None
                row["note"] = f"shape {list(shape)} on vlens, {list(their_shape)} on {label}"
            else:
                scale = float(b.abs().max()) if b.numel() else 0.0
                difference = float((a - b).abs().max()) if a.numel() else 0.0
                row["relative_difference"] = difference / max(scale, 1e-12)
            rows.append(row)
    return rows


def numbers_markdown(rows: list[dict], label: str) -> str:
    """:func:`compare`'s rows as a markdown section (empty without rows)."""
    if not rows:
        return ""
    lines = [
        "",
        f"## Numbers against {label}",
        "",
        f"Tensors and numbers a cell bound on both backends: `max|vlens - {label}| / "
        f"max|{label}|` (at most {KEPT:,} values of each, strided).",
        "",
        "| # | name | shape | relative difference |",
        "| --- | --- | --- | --- |",
    ]
    for row in rows:
        difference = row["relative_difference"]
        shown = row.get("note", "") if difference is None else f"{difference:.2e}"
        lines.append(f"| {row['cell']} | `{row['name']}` | {row['shape']} | {shown} |")
    return "\n".join(lines) + "\n"


def recorded_report(
    runner: Recording, notebook: Notebook, results: list[CellResult], path: Path,
    args: argparse.Namespace, reference: str, label: str,
) -> dict[str, Any]:
    """A run's report: its settings, environment and cells; saves the run's record under
    ``args.values`` and, on vlens, compares it with backend ``reference``'s record of the
    notebook (``label``: that backend's name in the notes)."""
    import torch

    args.values.mkdir(parents=True, exist_ok=True)
    torch.save(runner.values, args.values / f"{args.backend}-{notebook.name}.pt")
    load_seconds = runner.slot.load_seconds
    report: dict[str, Any] = {
        "notebook": notebook.name,
        "origin": notebook.origin,
        "backend": args.backend,
        "ci": True,
        "stop_in_cell": False,
        "cell_timeout": args.cell_timeout,
        "threads": args.threads,
        "load_seconds": None if load_seconds is None else round(load_seconds, 1),
        "environment": environment(args.backend, path),
        "summary": counts(results),
        "cells": [asdict(result) for result in results],
    }
    theirs = args.values / f"{reference}-{notebook.name}.pt"
    if args.backend == "vlens" and theirs.is_file():
        report["numbers"] = compare(runner.values, torch.load(theirs), label)
    return report
