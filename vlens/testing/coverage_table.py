"""``python -m vlens.testing.coverage_table [README]``: regenerate the README's table of served
architectures (its "Architectures" section; ``README.md`` unless a path is given).

One row per architecture a mapping file serves (with a tiny model to prove it): how vLLM runs
it, how many names it has (a block's names once, and those before and after the blocks), its parity status as ``parity/REPORT.md`` records it (the worst
relative error per reference, or "not in the report"), and whether the compiled engine and tensor
parallelism are offered (the mapping's own ``compiled_graph`` and ``tensor_parallel`` flags, each
set only where its tests pass). Written between ``<!-- coverage:start -->`` and
``<!-- coverage:end -->``.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

from vlens.engine.arguments import why_not
from vlens.mappings import all_mappings, vllm_implementation
from vlens.mappings._tiny import architecture_of
from vlens.names.mapping import DEFAULT_GRAPH, ArchitectureMapping
from vlens.testing.names_table import replace_section

START, END = "<!-- coverage:start -->", "<!-- coverage:end -->"
#: The parity report, found beside the parity package's modules (without importing it: the
#: parity package builds its checkpoints with this one's tiny models).
REPORT = Path(find_spec("vlens.parity").submodule_search_locations[0]) / "REPORT.md"

_SECTION = re.compile(r"^### (\S+) \((\w+)\)$")
_ROW = re.compile(r"^\| `[^`]+` \| [^|]+ \| \w+ \| (\w+) \| [^|]+ \| ([^|]+) \| [^|]+ \| (\w+) \|$")


@dataclass
class ParityStatus:
    """One tiny model's rows in the parity report: the worst relative error per reference and
    whether every row was within tolerance."""

    worst: dict[str, float] = field(default_factory=dict)
    all_ok: bool = True


def parity_statuses(report: str) -> dict[str, ParityStatus]:
    """Each tiny model's status in a parity report (``parity/REPORT.md``)."""
    statuses: dict[str, ParityStatus] = {}
    current: ParityStatus | None = None
    for line in report.splitlines():
        if section := _SECTION.match(line):
            current = statuses.setdefault(section.group(1), ParityStatus())
        elif current is not None and (row := _ROW.match(line)):
            reference, error, ok = row.group(1), float(row.group(2)), row.group(3) == "yes"
            current.worst[reference] = max(current.worst.get(reference, 0.0), error)
            current.all_ok &= ok
    return statuses


def route(architecture: str) -> str:
    """How vLLM builds ``architecture``: its own implementation, or its Transformers backend."""
    implementation = vllm_implementation(architecture)
    if implementation is None:
        return "—"
    module, _ = implementation
    return "Transformers backend" if module.rsplit(".", 1)[-1] == "transformers" else "native"


def coverage_table(report: str) -> str:
    statuses = parity_statuses(report)
    lines = [
        "| architecture | tiny model | vLLM | names per layer and around | parity vs HuggingFace | vs TransformerLens "
        "| compiled engine | tensor parallel |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mapping in all_mappings():
        for tiny, build in mapping.tiny_configs.items():
            config = build()
            architecture = architecture_of(config)
            names = len(mapping.hook_specs(config))
            status = statuses.get(tiny)
            if status is None:
                against_hf = against_tl = "not in the report"
            else:
                verdict = "" if status.all_ok else " (FAILS)"
                against_hf = _worst(status, "HuggingFace") + verdict
                against_tl = _worst(status, "TransformerLens")
                if mapping.no_bridge_reference is not None:
                    against_tl = "— (no bridge reference)"
            lines.append(
                f"| `{architecture}` | `{tiny}` | {route(architecture)} | {names} | {against_hf} "
                f"| {against_tl} | {_offer(mapping, 'compiled_graph')} "
                f"| {_offer(mapping, 'tensor_parallel')} |"
            )
    return "\n".join(lines)


def _worst(status: ParityStatus, reference: str) -> str:
    return f"≤ {status.worst[reference]:.1e}" if reference in status.worst else "—"


def _offer(mapping: ArchitectureMapping, offer: str) -> str:
    """"yes", or "no: " and why (the mapping's own reason, else the refusal's); for the compiled
    engine, why a GPU's default engine is not it, where the mapping says."""
    if not getattr(mapping, offer):
        return f"no: {why_not(mapping, offer)}"
    default = mapping.not_offered.get(DEFAULT_GRAPH) if offer == "compiled_graph" else None
    return "yes" if default is None else f"yes, when declared ({default})"


def main(argv: list[str]) -> int:
    table = coverage_table(REPORT.read_text())
    replace_section(Path(argv[0] if argv else "README.md"), START, END, table)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
