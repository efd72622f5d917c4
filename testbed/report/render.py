"""Render the report context into HTML and Markdown (jinja2 templates in templates/)."""

from __future__ import annotations

import jinja2
from markupsafe import Markup

import testbed
from testbed.report.content import Table

_LOADER = jinja2.PackageLoader("testbed.report", "templates")


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def md_table(table: Table | None) -> str:
    """A pipe table padded to column width, so it also reads well in a terminal."""
    if table is None:
        return ""
    head = [_md_cell(c) for c in table.columns]
    body = [[_md_cell(c) for c in row] for row in table.rows]
    widths = [max([len(head[i]), 3, *(len(r[i]) for r in body)]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(
            c.rjust(w) if table.numeric[i] else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if table.numeric[i] else "-" * (w + 2)
                          for i, w in enumerate(widths)) + "|"
    lines = [line(head), rule, *(line(r) for r in body)]
    if table.note:
        lines += ["", f"_{table.note}_"]
    return "\n".join(lines)


def _html_env() -> jinja2.Environment:
    return jinja2.Environment(loader=_LOADER, autoescape=True, undefined=jinja2.StrictUndefined,
                              trim_blocks=True, lstrip_blocks=True)


def _md_env() -> jinja2.Environment:
    env = jinja2.Environment(loader=_LOADER, autoescape=False,
                             undefined=jinja2.StrictUndefined, trim_blocks=True,
                             lstrip_blocks=True, keep_trailing_newline=True)
    env.filters["md_table"] = md_table
    return env


def _mark_svgs(ctx: dict) -> dict:
    """Plots are markup we made ourselves; everything else is escaped."""
    out = dict(ctx)
    if out.get("fabric"):
        out["fabric"] = {**out["fabric"], "svg": Markup(out["fabric"]["svg"])}
    for key in ("queues", "ecn", "rates", "dcqcn", "fct"):
        if out.get(key):
            out[key] = {**out[key], "svgs": [Markup(s) for s in out[key]["svgs"]]}
    verdict = out.get("verdict")
    if verdict and verdict.get("evidence") and verdict["evidence"].get("svg"):
        out["verdict"] = {**verdict, "evidence": {**verdict["evidence"],
                                                  "svg": Markup(verdict["evidence"]["svg"])}}
    if out.get("pfc") and out["pfc"].get("svg"):
        out["pfc"] = {**out["pfc"], "svg": Markup(out["pfc"]["svg"])}
    if out.get("collectives"):
        c = dict(out["collectives"])
        if c.get("timeline"):
            c["timeline"] = {**c["timeline"], "svg": Markup(c["timeline"]["svg"])}
        if c.get("occupancy"):
            c["occupancy"] = {**c["occupancy"],
                              "svgs": [Markup(s) for s in c["occupancy"]["svgs"]]}
        out["collectives"] = c
    return out


def render_html(ctx: dict) -> str:
    return _html_env().get_template("report.html.j2").render(
        **_mark_svgs(ctx), version=testbed.__version__)


def render_md(ctx: dict) -> str:
    text = _md_env().get_template("report.md.j2").render(**ctx, version=testbed.__version__)
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text.lstrip("\n")


def render_template(name: str, ctx: dict, html: bool) -> str:
    """Another page of templates/ (testbed compare's), HTML (escaped) or Markdown."""
    if html:
        return _html_env().get_template(name).render(**ctx, version=testbed.__version__)
    text = _md_env().get_template(name).render(**ctx, version=testbed.__version__)
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text.lstrip("\n")
