"""The README's names table is generated from the mapping files; it must not drift from them."""

from pathlib import Path

from vlens.names_table import END, START, names_table


def test_readme_names_table_is_current():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    shown = readme.split(START, 1)[1].split(END, 1)[0].strip()
    assert shown == names_table(), "run: python -m vlens.names_table README.md"
