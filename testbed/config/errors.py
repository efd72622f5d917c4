"""Config problems a user can act on: `FILE:LINE: path.to.field: message`."""

from __future__ import annotations

from dataclasses import dataclass


def format_loc(loc: tuple) -> str:
    """('links', 3, 'port') -> 'links[3].port'; ('qos', 'x', 'buffer', '3') -> 'qos.x.buffer[3]'.

    Numbers, list indices and numeric mapping keys alike, are written in brackets.
    """
    out = ""
    for part in loc:
        if isinstance(part, int) or (isinstance(part, str) and part.isdigit()):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


@dataclass(frozen=True)
class Problem:
    line: int
    loc: tuple
    message: str

    def format(self, file: str) -> str:
        return f"{file}:{self.line}: {format_loc(self.loc)}: {self.message}"


class ConfigError(Exception):
    """Every problem found in one config file, in line order."""

    def __init__(self, file: str, problems: list[Problem]) -> None:
        self.file = file
        self.problems = sorted(problems, key=lambda p: (p.line, format_loc(p.loc)))
        super().__init__("\n".join(p.format(file) for p in self.problems))

    def lines(self) -> list[str]:
        return [p.format(self.file) for p in self.problems]
