"""``python -m vlens.names_table [README]``: regenerate the README's table of hook names.

The table is made from the mapping files themselves (every name, per architecture, with its
shape), between the markers ``<!-- names:start -->`` and ``<!-- names:end -->``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from transformers import AutoConfig

from vlens.mappings import all_mappings
from vlens.testing import CONFIG_BUILDERS, tiny_model

START, END = "<!-- names:start -->", "<!-- names:end -->"


def names_table() -> str:
    """One column per architecture; a row per name; each cell the shape (batch axis first)."""
    columns: dict[str, dict[str, str]] = {}
    for arch in CONFIG_BUILDERS:
        config = AutoConfig.from_pretrained(tiny_model(arch))
        for mapping in all_mappings():
            if config.architectures[0] in mapping.architectures:
                specs = mapping.hook_specs(config)
                columns[config.architectures[0]] = {n: s.shape for n, s in specs.items()}
    names = list(dict.fromkeys(name for column in columns.values() for name in column))
    lines = [
        "| name | " + " | ".join(f"`{arch}`" for arch in columns) + " |",
        "| --- |" + " --- |" * len(columns),
    ]
    for name in names:
        cells = [f"`[batch {column[name]}]`" if name in column else "—" for column in columns.values()]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    readme = Path(argv[0] if argv else "README.md")
    text = readme.read_text()
    before, rest = text.split(START, 1)
    _, after = rest.split(END, 1)
    readme.write_text(f"{before}{START}\n{names_table()}\n{END}{after}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
