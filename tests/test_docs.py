"""The README's generated tables must not drift from the mapping files (and the parity report)."""

from pathlib import Path

from vlens import coverage_table, names_table

README = Path(__file__).parent.parent / "README.md"


def shown(start: str, end: str) -> str:
    return README.read_text().split(start, 1)[1].split(end, 1)[0].strip()


def test_readme_names_table_is_current():
    table = names_table.names_table()
    assert shown(names_table.START, names_table.END) == table, (
        "run: python -m vlens.names_table README.md"
    )


def test_readme_coverage_table_is_current():
    table = coverage_table.coverage_table(coverage_table.REPORT.read_text())
    assert shown(coverage_table.START, coverage_table.END) == table, (
        "run: python -m vlens.coverage_table README.md"
    )


def test_every_served_architecture_passes_parity_in_the_report():
    statuses = coverage_table.parity_statuses(coverage_table.REPORT.read_text())
    from vlens.testing import ARCHS

    missing = [arch for arch in ARCHS if arch not in statuses]
    failing = [arch for arch, status in statuses.items() if not status.all_ok]
    assert not missing and not failing, (
        f"not in parity/REPORT.md: {missing}; failing there: {failing} "
        "(run: python -m vlens.parity --out parity/REPORT.md)"
    )
