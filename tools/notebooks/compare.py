"""Bridge against vlens, cell by cell, from the runner's JSON results.

    python tools/notebooks/compare.py            # every notebook with both results in results/

Writes ``results/compare-<notebook>.md`` (each cell's status per backend, and the cells that run
on the bridge but not on vlens) and ``results/missing-pieces.md``: each failure of the ``vlens``
and ``vlens-probe`` runs reduced to the piece of model API it names, with the cells (of those
that run on the bridge) that need it.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
BACKENDS = ("bridge", "vlens", "vlens-probe")

#: (pattern on "Type: message", piece) — the first match names the piece.
PIECES: list[tuple[str, str]] = [
    (r"'HookedVLLM' object is not callable", "model(input, ...) / forward"),
    (r"'ModelConfig' object has no attribute '(\w+)'", "model.cfg.{0}"),
    (r"'(?:HookedVLLM|ProbeModel)' object has no attribute '(\w+)'", "model.{0}"),
    (r"'BlockWeights' object has no attribute '(\w+)'", "model.blocks[i].{0}"),
    (r"'AttentionWeights' object has no attribute '(\w+)'", "model.blocks[i].attn.{0}"),
    (r"'MlpWeights' object has no attribute '(\w+)'", "model.blocks[i].mlp.{0}"),
    (r"HookedVLLM\.(\w+)\(\) got an unexpected keyword argument '(\w+)'", "model.{0}({1}=)"),
    (r"return_type must be 'logits' or None, not '(\w+)'", 'return_type="{0}"'),
    (
        r"(\S*hook_(?:pattern|attn_scores)) cannot carry a hook",
        "hooks on hook_pattern / hook_attn_scores",
    ),
    (r"'int' object is not iterable", "model.to_string(int)"),
    (
        r"HookError: .*must match the existing size \((\d+)\)",
        "hook functions get one request's [1, pos, ...], not the batch",
    ),
    (
        r"HookError: .* raised AttributeError\(\"'(\w+)' object has no attribute '(\w+)'",
        "{0}.{1} (inside a hook)",
    ),
]


def piece_of(failure: dict[str, Any]) -> str:
    text = f"{failure['type']}: {failure['message']}"
    for pattern, piece in PIECES:
        match = re.search(pattern, text)
        if match:
            return piece.format(*match.groups())
    return text[:120]


def load(backend: str, notebook: str) -> dict[str, Any] | None:
    path = RESULTS / f"{backend}-{notebook}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def notebooks() -> list[str]:
    names = {p.stem.split("-", 1)[1] for p in RESULTS.glob("bridge-*.json")}
    return sorted(n for n in names if (RESULTS / f"vlens-{n}.json").is_file())


@dataclass
class Piece:
    """One piece of model API and the cells (that run on the bridge) that need it."""

    name: str
    first: dict[str, set[int]] = field(
        default_factory=lambda: defaultdict(set)
    )  # notebook -> cells
    later: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    cascades: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    messages: set[str] = field(default_factory=set)

    def needed_by(self) -> int:
        """Cells that cannot pass without it: where it fails, and the cascades from there."""
        return sum(len(self.cells(nb)) for nb in {*self.first, *self.later, *self.cascades})

    def cells(self, notebook: str) -> set[int]:
        return self.first[notebook] | self.later[notebook] | self.cascades[notebook]


def cascades_from(cells: list[dict[str, Any]], root: int) -> list[int]:
    return [
        c["index"]
        for c in cells
        if c["status"] in ("cascade", "skipped")
        and c["failures"]
        and c["failures"][0]["cascade_from"] == root
    ]


def pieces(
    names: list[str], backends: tuple[str, ...] = ("vlens", "vlens-probe"), bridge_ok: bool = True
) -> list[Piece]:
    """Every failure of the vlens runs (the plain one, and the probe that fills the first missing
    pieces so the next ones show) reduced to its piece, counted on cells that run on the bridge
    (``bridge_ok=False``: on the cells that fail on the bridge too)."""
    found: dict[str, Piece] = {}
    for notebook in names:
        bridge = load("bridge", notebook)
        if bridge is None:
            continue
        ok_on_bridge = {c["index"] for c in bridge["cells"] if (c["status"] == "ok") == bridge_ok}
        for backend in backends:
            run = load(backend, notebook)
            for cell in run["cells"] if run else []:
                if cell["index"] not in ok_on_bridge:
                    continue
                own = [f for f in cell["failures"] if f["kind"] in ("error", "timeout")]
                for position, failure in enumerate(own):
                    piece = found.setdefault(piece_of(failure), Piece(piece_of(failure)))
                    piece.messages.add(f"{failure['type']}: {failure['message']}"[:300])
                    where = (
                        piece.first if position == 0 and cell["status"] == "error" else piece.later
                    )
                    where[notebook].add(cell["index"])
                    lost = cascades_from(run["cells"], cell["index"]) if position == 0 else []
                    piece.cascades[notebook].update(i for i in lost if i in ok_on_bridge)
    for piece in found.values():  # a cell the piece fails in is not also its cascade
        for notebook in piece.cascades:
            piece.cascades[notebook] -= piece.first[notebook] | piece.later[notebook]
    return sorted(found.values(), key=lambda p: (-p.needed_by(), p.name))


def _cells(by_notebook: dict[str, set[int]]) -> str:
    return (
        "; ".join(f"{nb} {sorted(cells)}" for nb, cells in sorted(by_notebook.items()) if cells)
        or "—"
    )


def missing_markdown(names: list[str]) -> str:
    lines = [
        "# What the notebooks hit on vlens, by piece of model API",
        "",
        (
            "Generated by `tools/notebooks/compare.py` from the `vlens` and `vlens-probe` results, "
            "on cells that run on the bridge. *Needed by*: the cells where the piece fails (first "
            "or after another failure, in either run) and the cascades from those cells."
        ),
        "",
        "| piece | needed by (cells) | first failure in | after another failure in | cascades | message |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    lines += _piece_rows(pieces(names))
    lines += [
        "",
        "## In cells that fail on the bridge too",
        "",
        "| piece | cells | first failure in | after another failure in | cascades | message |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    lines += _piece_rows(pieces(names, bridge_ok=False))
    return "\n".join(lines) + "\n"


def _piece_rows(found: list[Piece]) -> list[str]:
    rows = []
    for piece in found:
        message = min(piece.messages).replace("|", "\\|")
        rows.append(
            f"| `{piece.name}` | {piece.needed_by()} | {_cells(piece.first)} | {_cells(piece.later)} "
            f"| {_cells(piece.cascades)} | {message[:200]} |"
        )
    return rows


def _status(cell: dict[str, Any] | None) -> str:
    if cell is None:
        return "—"
    text = cell["status"] + (f": {cell['detail']}" if cell["detail"] else "")
    return text[:140].replace("|", "\\|").replace("\n", " ")


def compare_markdown(notebook: str) -> str:
    runs = {backend: load(backend, notebook) for backend in BACKENDS}
    present = [b for b in BACKENDS if runs[b] is not None]
    by_index = {b: {c["index"]: c for c in runs[b]["cells"]} for b in present}
    bridge = by_index["bridge"]
    lost = [
        i
        for i, c in bridge.items()
        if c["status"] == "ok" and by_index["vlens"][i]["status"] != "ok"
    ]
    gained = [
        i
        for i, c in bridge.items()
        if c["status"] != "ok" and by_index["vlens"][i]["status"] == "ok"
    ]
    lines = [f"# {notebook}: bridge against vlens", ""]
    for backend in present:
        lines.append(f"- {backend}: {runs[backend]['summary']}")
    lines += [
        f"- ok on the bridge, not on vlens ({len(lost)}): {lost}",
        f"- ok on vlens, not on the bridge ({len(gained)}): {gained}",
        "",
        "| # | first line | " + " | ".join(present) + " |",
        "| --- | --- | " + " | ".join("---" for _ in present) + " |",
    ]
    for index, cell in bridge.items():
        statuses = " | ".join(_status(by_index[b].get(index)) for b in present)
        first = cell["first_line"][:60].replace("|", "\\|")
        lines.append(f"| {index} | `{first}` | {statuses} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    names = notebooks()
    if not names:
        print(f"no notebook has both bridge and vlens results in {RESULTS}", file=sys.stderr)
        return 1
    for notebook in names:
        path = RESULTS / f"compare-{notebook}.md"
        path.write_text(compare_markdown(notebook))
        print(path)
    path = RESULTS / "missing-pieces.md"
    path.write_text(missing_markdown(names))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
