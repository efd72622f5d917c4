"""docs/run-format.md's result-row tables, generated from what each workload kind declares
(its kind names, `doc` and `result_fields`), so the documented columns are the written ones.

    python -m testbed.workloads.docs --write docs/run-format.md   # regenerate (make docs)
    python -m testbed.workloads.docs --check docs/run-format.md   # exit 1 with a diff if stale

Only the text between `<!-- generated:results:BEGIN -->` and `<!-- generated:results:END -->`
is replaced; tests/unit/test_result_rows.py checks the file and that every kind writes
exactly the columns it declares.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path

from testbed.workloads.registry import REGISTRY

BEGIN = "<!-- generated:results:BEGIN -->"
END = "<!-- generated:results:END -->"


def result_tables() -> str:
    """One table per registered kind module: its kinds, what it runs, its columns."""
    parts = []
    for kind in REGISTRY.kinds():
        names = ", ".join(f"`{n}`" for n in kind.shapes)
        example = json.dumps(dict(kind.example), separators=(", ", ": "))
        lines = [f"#### {names}", "", kind.doc, "", f"For example `{example}`.", "",
                 "| column | meaning |", "|---|---|"]
        lines += [f"| `{column}` | {meaning} |" for column, meaning in kind.result_fields.items()]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def render(text: str) -> str:
    """`text` with its generated region replaced by the current tables."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {BEGIN} ... {END} region; add the two markers where the "
                         "result-row tables go")
    return text[:start + len(BEGIN)] + "\n" + result_tables() + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.workloads.docs",
                                     description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", type=Path, metavar="MD")
    mode.add_argument("--check", type=Path, metavar="MD")
    args = parser.parse_args(argv)
    path = args.write or args.check
    text = path.read_text(encoding="utf-8")
    new = render(text)
    if args.write:
        path.write_text(new, encoding="utf-8")
        return 0
    if new != text:
        sys.stdout.writelines(difflib.unified_diff(
            text.splitlines(True), new.splitlines(True), f"{path} (committed)",
            f"{path} (generated)"))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
