"""The generated tables must not drift from the mapping files (and the parity report): the
architectures table in README.md, the names table in docs/hook-names.md."""

import re
from pathlib import Path

import pytest

from vlens.names.tl_versions import HAS_BRIDGE
from vlens.testing import coverage_table, names_table

#: Tables of every architecture: the Transformers backend's names come from TransformerLens 4's
#: adapters, which TransformerLens 3 (beside SAELens) does not have.
NEEDS_BRIDGE = pytest.mark.skipif(not HAS_BRIDGE, reason="TransformerLens 4's adapters")

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
NAMES_PAGE = ROOT / names_table.PAGE


def shown(page: Path, start: str, end: str) -> str:
    return page.read_text().split(start, 1)[1].split(end, 1)[0].strip()


@NEEDS_BRIDGE
def test_names_table_is_current():
    table = names_table.names_table()
    assert shown(NAMES_PAGE, names_table.START, names_table.END) == table, (
        "run: python -m vlens.testing.names_table"
    )


@NEEDS_BRIDGE
def test_readme_coverage_table_is_current():
    table = coverage_table.coverage_table(coverage_table.REPORT.read_text())
    assert shown(README, coverage_table.START, coverage_table.END) == table, (
        "run: python -m vlens.testing.coverage_table"
    )


def test_every_served_architecture_passes_parity_in_the_report():
    statuses = coverage_table.parity_statuses(coverage_table.REPORT.read_text())
    from vlens.testing.tiny import ARCHS

    missing = [arch for arch in ARCHS if arch not in statuses]
    failing = [arch for arch, status in statuses.items() if not status.all_ok]
    assert not missing and not failing, (
        f"not in parity/REPORT.md: {missing}; failing there: {failing} "
        "(run: python -m vlens.parity --out parity/REPORT.md)"
    )


def test_every_relative_link_of_the_docs_points_at_a_file():
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path = target.split("#", 1)[0]
            if path and "://" not in path and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
