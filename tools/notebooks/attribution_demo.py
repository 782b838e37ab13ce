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
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from notebook_cells import MIRROR, Notebook, load  # noqa: E402
from recorded_values import Recording, numbers_markdown, recorded_report  # noqa: E402
from run_notebook import (  # noqa: E402
    RESULTS,
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


def with_gradients(notebook: Notebook) -> Notebook:
    """The demo with its gradient cells no longer skipped: both backends compute gradients."""
    for cell in notebook.cells:
        if cell.skip_reason and cell.skip_reason.startswith("needs gradients"):
            cell.skip_reason = None
    return notebook


def run(args: argparse.Namespace) -> dict[str, Any]:
    notebook = with_gradients(load(DEMO, args.mirror))
    path = args.model or smollm2()
    runner = Recording(notebook, args.backend, path, args.cell_timeout)
    results = runner.run(parse_cells(args.cells), progress_printer(args.backend, notebook))
    return recorded_report(runner, notebook, results, path, args, "bridge", "the bridge")


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
    md_path.write_text(markdown(report) + numbers_markdown(report.get("numbers", []), "the bridge"))
    print(f"{report['notebook']} on {report['backend']}: {report['summary']}\n  {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
