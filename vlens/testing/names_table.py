"""``python -m vlens.testing.names_table [PAGE]``: regenerate the table of hook names in
``docs/hook-names.md`` (or ``PAGE``).

The table is made from the mapping files themselves (every name, per architecture, with its
shape, for the config of each tiny model they declare), between the markers
``<!-- names:start -->`` and ``<!-- names:end -->``. Architectures with the same names and shapes
share a column.
"""

from __future__ import annotations

import sys
from pathlib import Path

from vlens.mappings import all_mappings
from vlens.mappings._tiny import architecture_of

START, END = "<!-- names:start -->", "<!-- names:end -->"
#: The page the table lives on, relative to the repository's root.
PAGE = Path("docs") / "hook-names.md"


def columns() -> dict[str, dict[str, str]]:
    """Each architecture a tiny model stands for → its names and their shapes."""
    found: dict[str, dict[str, str]] = {}
    for mapping in all_mappings():
        for build in mapping.tiny_configs.values():
            config = build()
            specs = mapping.hook_specs(config)
            found[architecture_of(config)] = {name: spec.shape for name, spec in specs.items()}
    return found


def merged_order(orders: list[list[str]]) -> list[str]:
    """Every name of ``orders`` once, each name a list adds placed right after the name before it
    in that list (forward order, where each list is in forward order)."""
    merged: list[str] = []
    for order in orders:
        previous = None
        for name in order:
            if name not in merged:
                merged.insert(0 if previous is None else merged.index(previous) + 1, name)
            previous = name
    return merged


def names_table() -> str:
    """One column per group of architectures with the same names and shapes, the largest group
    first; a row per name; each cell the shape (batch axis first)."""
    groups: list[tuple[list[str], dict[str, str]]] = []
    for architecture, shapes in columns().items():
        same = next((group for group in groups if group[1] == shapes), None)
        if same is None:
            groups.append(([architecture], shapes))
        else:
            same[0].append(architecture)
    groups.sort(key=lambda group: -len(group[0]))
    names = merged_order([list(shapes) for _, shapes in groups])
    headers = [", ".join(f"`{architecture}`" for architecture in group) for group, _ in groups]
    lines = ["| name | " + " | ".join(headers) + " |", "| --- |" + " --- |" * len(groups)]
    for name in names:
        cells = [f"`[batch {shapes[name]}]`" if name in shapes else "—" for _, shapes in groups]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def replace_section(page: Path, start: str, end: str, body: str) -> None:
    """Write ``body`` between the ``start`` and ``end`` markers of ``page`` (a generated
    section), leaving the rest of the file as it is."""
    before, rest = page.read_text().split(start, 1)
    _, after = rest.split(end, 1)
    page.write_text(f"{before}{start}\n{body}\n{end}{after}")


def main(argv: list[str]) -> int:
    replace_section(Path(argv[0]) if argv else PAGE, START, END, names_table())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
