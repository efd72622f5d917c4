"""`testbed probe`: what this kernel can do, and what each missing piece disables."""

from __future__ import annotations

from rich.table import Table

from testbed.cli.common import EXIT_OK, CliError, add_format, print_json, require_root, wide_console


def add_parser(sub):
    p = sub.add_parser("probe", help="try each kernel feature in a scratch namespace")
    add_format(p)
    return p


def run(args) -> int:
    from testbed.net.probe import probe_report

    try:
        require_root("probe")
    except CliError as exc:
        print(exc)
        return exc.code
    report = probe_report()
    if args.format == "json":
        print_json(report)
        return EXIT_OK
    table = Table(title=f"kernel {report['kernel']} ({report['machine']})")
    for col in ("feature", "present", "detail", "if missing"):
        table.add_column(col)
    for name, f in report["features"].items():
        table.add_row(name, "[green]yes[/]" if f["present"] else "[red]no[/]", f["detail"],
                      "" if f["present"] else f["disables"])
    wide_console().print(table)
    return EXIT_OK
