"""Run TransformerLens's ``Attribution_Patching_Demo`` cell by cell on its bridge or on vlens,
gradients included, and compare the numbers.

    .venv/bin/python tools/notebooks/attribution_demo.py --backend bridge
    .venv/bin/python tools/notebooks/attribution_demo.py --backend vlens
    .venv/bin/python tools/notebooks/attribution_demo.py --backend vlens --cells 0-18

The demo is read from the TransformerLens mirror (as :mod:`run_notebook` reads demos) and runs
through :class:`run_notebook.Runner` (statuses, display stubs, magics dropped, the model swapped
for SmolLM2-135M, fp32, unprocessed), with one difference: its cells that call ``.backward()``
run (the generic runner skips them), on the bridge's own autograd or on vlens's gradient twin.

After each cell the tensors and numbers it bound are kept (at most :data:`KEPT` values each) in
``<values>/<backend>-Attribution_Patching_Demo.pt``; the ``vlens`` report ends with
``max|vlens - bridge| / max|bridge|`` for each, read from the bridge's record of an earlier run.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import notebook_stubs  # noqa: E402
from notebook_cells import MIRROR, Cell, Notebook, load  # noqa: E402
from run_notebook import (  # noqa: E402
    RESULTS,
    CellResult,
    Runner,
    counts,
    environment,
    markdown,
    parse_cells,
    progress_printer,
    settle_environment,
    smollm2,
    write,
)

DEMO = "Attribution_Patching_Demo"
BACKENDS = ("bridge", "vlens")
VALUES = Path("/tmp/attribution_demo_values")
#: Values kept per recorded tensor (a strided subsample of larger ones).
KEPT = 100_000


def with_gradients(notebook: Notebook) -> Notebook:
    """The demo with its gradient cells no longer skipped: both backends compute gradients."""
    for cell in notebook.cells:
        if cell.skip_reason and cell.skip_reason.startswith("needs gradients"):
            cell.skip_reason = None
    return notebook


class RecordingRunner(Runner):
    """:class:`run_notebook.Runner`, keeping the floating tensors and numbers each cell binds."""

    def __init__(self, notebook: Notebook, backend: str, path: Path, timeout: float) -> None:
        super().__init__(notebook, backend, path, timeout, stop_in_cell=False)
        # ray (imported by vLLM here) registers callbacks on IPython's events when it sees IPython
        notebook_stubs.get_ipython().events = notebook_stubs.Sink()  # type: ignore[attr-defined]
        self.values: dict[int, dict[str, tuple[tuple[int, ...], Any]]] = {}

    def run_cell(self, cell: Cell) -> CellResult:
        import torch

        result = super().run_cell(cell)
        kept = {}
        for name in sorted(cell.bound):
            value = self.namespace.get(name)
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                flat = value.detach().flatten().cpu()
                step = max(1, flat.numel() // KEPT)
                kept[name] = (tuple(value.shape), flat[::step][:KEPT].double().clone())
            elif isinstance(value, float | int) and not isinstance(value, bool):
                kept[name] = ((), torch.tensor([float(value)], dtype=torch.float64))
        self.values[cell.index] = kept
        return result


def compare(ours: dict[int, dict[str, Any]], theirs: dict[int, dict[str, Any]]) -> list[dict]:
    """Per cell and name recorded on both: shapes, and ``max|a-b| / max|b|`` where they match."""
    rows = []
    for index in sorted(set(ours) & set(theirs)):
        for name in sorted(set(ours[index]) & set(theirs[index])):
            (shape, a), (their_shape, b) = ours[index][name], theirs[index][name]
            row: dict[str, Any] = {"cell": index, "name": name, "shape": list(shape)}
            if shape != their_shape:
                row["relative_difference"] = None
                row["note"] = f"shape {list(shape)} on vlens, {list(their_shape)} on the bridge"
            else:
                scale = float(b.abs().max()) if b.numel() else 0.0
                difference = float((a - b).abs().max()) if a.numel() else 0.0
                row["relative_difference"] = difference / max(scale, 1e-12)
            rows.append(row)
    return rows


def numbers_markdown(rows: list[dict]) -> str:
    if not rows:
        return ""
    lines = [
        "",
        "## Numbers against the bridge",
        "",
        "Tensors and numbers a cell bound on both backends: `max|vlens - bridge| / max|bridge|` "
        f"(at most {KEPT:,} values of each, strided).",
        "",
        "| # | name | shape | relative difference |",
        "| --- | --- | --- | --- |",
    ]
    for row in rows:
        difference = row["relative_difference"]
        shown = row.get("note", "") if difference is None else f"{difference:.2e}"
        lines.append(f"| {row['cell']} | `{row['name']}` | {row['shape']} | {shown} |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    notebook = with_gradients(load(DEMO, args.mirror))
    path = args.model or smollm2()
    runner = RecordingRunner(notebook, args.backend, path, args.cell_timeout)
    results = runner.run(parse_cells(args.cells), progress_printer(args.backend, notebook))
    args.values.mkdir(parents=True, exist_ok=True)
    torch.save(runner.values, args.values / f"{args.backend}-{DEMO}.pt")
    report: dict[str, Any] = {
        "notebook": notebook.name,
        "origin": notebook.origin,
        "backend": args.backend,
        "ci": True,
        "stop_in_cell": False,
        "cell_timeout": args.cell_timeout,
        "threads": args.threads,
        "load_seconds": None
        if runner.slot.load_seconds is None
        else round(runner.slot.load_seconds, 1),
        "environment": environment(args.backend, path),
        "summary": counts(results),
        "cells": [asdict(result) for result in results],
    }
    reference = args.values / f"bridge-{DEMO}.pt"
    if args.backend == "vlens" and reference.is_file():
        report["numbers"] = compare(runner.values, torch.load(reference))
    return report


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=BACKENDS, required=True)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--mirror", type=Path, default=MIRROR, help="TransformerLens git dir")
    parser.add_argument("--model", type=Path, default=None, help="default: smollm2_path()")
    parser.add_argument("--values", type=Path, default=VALUES)
    parser.add_argument("--cell-timeout", type=float, default=600.0)
    parser.add_argument("--cells", default=None, help="run only these cells, e.g. 0-18,25")
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    settle_environment(ci=True, threads=args.threads)
    report = run(args)
    json_path, md_path = write(report, args.out)
    md_path.write_text(markdown(report) + numbers_markdown(report.get("numbers", [])))
    print(f"{report['notebook']} on {report['backend']}: {report['summary']}\n  {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
