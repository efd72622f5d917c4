"""Helpers shared by verb modules: load + plan with user-facing errors, root checks."""

from __future__ import annotations

import json
import os
import sys
from typing import Annotated, Any

from pydantic import BaseModel
from rich.console import Console

from testbed.config import ConfigError, LoadedConfig, load_config
from testbed.plan import Plan, compile_plan

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class CliError(Exception):
    """A failure to report as one line and an exit code, without a traceback."""

    def __init__(self, message: str, code: int = EXIT_FAIL) -> None:
        super().__init__(message)
        self.code = code


def load_and_plan(path: str) -> tuple[LoadedConfig, Plan]:
    """Load and compile; `dilation: auto` uses this machine's calibrated capacity (and
    its learned derating) if any, else the conservative default."""
    from testbed.run.calibration import CalibrationError, load_budget_bps, load_capacity

    budget, _source = load_budget_bps()
    try:
        capacity = load_capacity()
    except CalibrationError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    try:
        loaded = load_config(path)
        return loaded, compile_plan(loaded, max_wall_port_rate_bps=budget, capacity=capacity)
    except ConfigError as exc:
        for line in exc.lines():
            print(line, file=sys.stderr)
        raise CliError(f"{len(exc.problems)} problem(s) in {path}", EXIT_USAGE) from None


def require_root(verb: str) -> None:
    if os.geteuid() != 0:
        raise CliError(f"`testbed {verb}` builds network namespaces and needs root "
                       "(run it with sudo)")


def wide_console() -> Console:
    """A rich console that does not squeeze tables to 80 columns when piped."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    return console


def print_json(data: object) -> None:
    print(json.dumps(data, indent=2, sort_keys=True))


def add_format(parser, choices=("table", "json"), default="table") -> None:
    parser.add_argument("--format", choices=choices, default=default,
                        help=f"output format (default {default})")


def check_arg(option: str, value: object, model: type[BaseModel], field: str) -> Any:
    """`value` validated exactly as `field` of config model `model`; CliError (exit 2) if bad.

    CLI options and config fields share one validator, so the command line is never
    looser than a config (`testbed phy --length 0` is refused as `length: 0` is).
    """
    from pydantic import TypeAdapter, ValidationError

    from testbed.config import describe_input

    info = model.model_fields[field]
    annotated: Any = Annotated[info.annotation, *info.metadata]
    adapter: TypeAdapter[Any] = TypeAdapter(annotated)
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] in ("greater_than", "greater_than_equal", "less_than",
                           "less_than_equal"):
            msg = f"{describe_input(value)}: {msg.lower()}"
        raise CliError(f"{option}: {msg} (the same check as `{info.alias or field}:` "
                       "in a config)", EXIT_USAGE) from None


def positive_seconds(text: str) -> float:
    """argparse type: a finite wall time in seconds, > 0 (not nan, not inf)."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text}")
    return value


def even_host_count(text: str) -> int:
    """argparse type: a host count >= 2 and even (trial fabrics pair their hosts)."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of hosts") from None
    if value < 2 or value % 2:
        raise argparse.ArgumentTypeError(f"must be an even number of hosts >= 2, got {value}")
    return value


def lab_name_arg(value: str, option: str = "NAME") -> str:
    """A lab name given on the command line, checked as the config's `name:` is (it names
    files under /run/testbed, so nothing like `../x` may get through)."""
    from testbed.config.models import Fabric

    return str(check_arg(option, value, Fabric, "name"))


def pfc_nodes_per_process(text: str) -> int | None:
    """argparse type of --pfc-nodes-per-process: `auto` (None) or a whole number >= 1."""
    import argparse

    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give auto or a whole number of nodes >= 1 (1: a process per node)")
    return value


def add_pfc_grouping_flag(p) -> None:  # noqa: ANN001 - an argparse (sub)parser
    """--pfc-nodes-per-process, for the commands that start PFC agents (run, up)."""
    p.add_argument("--pfc-nodes-per-process", type=pfc_nodes_per_process, default=None,
                   metavar="N|auto",
                   help="how many nodes one PFC agent process serves (default auto: one "
                        "per node up to 32 nodes, else one process per CPU with at most 16 "
                        "nodes each; 1: one per node; docs/pfc.md)")
