"""Plots for the report, returned as inline SVG markup.

matplotlib is used through `Figure` objects only (no pyplot, so no GUI
backend and no global figure state); SVG is rendered by the same non-
interactive machinery the Agg backend uses. Text stays text
(`svg.fonttype: none`), so the page is small and its numbers searchable, and
the SVG prolog and namespace URLs are stripped so the page references no
URL at all. Every axis speaks fabric units.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import matplotlib
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from testbed.plan.model import Plan

if TYPE_CHECKING:
    from matplotlib.typing import RcKeyType

_RC: dict[RcKeyType, Any] = {
    "svg.fonttype": "none",
    "svg.hashsalt": "testbed-report",        # deterministic ids
    "font.family": "sans-serif",
    "font.size": 11,
    "axes.titlesize": 13,
    "axes.titleweight": "bold",
    "axes.labelsize": 11,
    "legend.fontsize": 9.5,
    "xtick.labelsize": 10,
    "ytick.labelsize": 10,
    "axes.grid": True,
    "grid.alpha": 0.35,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "lines.linewidth": 1.6,
}
_SVG_METADATA = {"Date": None, "Creator": None, "Format": None, "Type": None}
SERIES_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
                 "#17becf"]
MAX_POINTS = 800     # per series; more samples are reduced to per-bucket min and max


@dataclass(frozen=True)
class Series:
    label: str
    points: Sequence[tuple[int, float]]     # (ts_fabric_ns, value)


@dataclass(frozen=True)
class FaultMark:
    """A fault of the run's timeline drawn on a time plot: a vertical line at the time
    it was applied (or, `converged`, at the time routes reconverged after it), labelled
    with `number`, the fault's row in the report's fault timeline."""

    number: int
    ts_fabric_ns: int
    text: str = ""              # short description, for the key under a plot
    converged: bool = False


@dataclass(frozen=True)
class Annotation:
    """An arrow to (ts_fabric_ns, value before y_divisor) with a text beside it."""

    ts_fabric_ns: float
    value: float
    text: str


FAULT_COLOR = "#7a0177"
MAX_FAULT_KEY = 8             # faults named under a plot; beyond, the key points to the table
_LABEL_ROWS = 3               # label heights, so close faults do not print on each other
_LABEL_GAP = 0.028            # axes fraction between two labels at one height


def time_unit(max_ns: float) -> tuple[float, str]:
    """Divisor and name of the unit a fabric-time axis is drawn in."""
    if max_ns < 20e6:
        return 1e3, "us"
    if max_ns < 20e9:
        return 1e6, "ms"
    return 1e9, "s"


def short_rate(bps: float) -> str:
    """400e9 -> '400G', 2.5e9 -> '2.5G' (fabric rates on the drawing)."""
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}"


def natural_key(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def plain(text: str) -> str:
    """Text shown as is: matplotlib would read $...$ as mathtext."""
    return text.replace("$", r"\$")


def reduce_points(points: Sequence[tuple[int, float]], limit: int = MAX_POINTS
                  ) -> list[tuple[int, float]]:
    """At most ~limit points that keep every bucket's minimum and maximum (peaks survive),
    and the last point (where the series ends)."""
    if len(points) <= limit:
        return list(points)
    per = math.ceil(len(points) / (limit // 2))
    out: list[tuple[int, float]] = []
    for i in range(0, len(points), per):
        bucket = points[i:i + per]
        lo = min(bucket, key=lambda p: p[1])
        hi = max(bucket, key=lambda p: p[1])
        out.extend(sorted({lo, hi}))
    if out[-1] != points[-1]:
        out.append(points[-1])
    return out


def _svg(fig: Figure, prefix: str, label: str) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata=_SVG_METADATA, bbox_inches="tight", pad_inches=0.1)
    text = buf.getvalue()
    text = text[text.index("<svg"):]
    # An inline <svg> in HTML needs neither the XML namespaces nor the DTD;
    # dropping them leaves no URL in the page.
    text = re.sub(r'\s+xmlns(:xlink)?="[^"]*"', "", text, count=2)
    # Several figures share one document: make their ids unique.
    text = re.sub(r'\bid="([^"]+)"', rf'id="{prefix}-\1"', text)
    text = re.sub(r"url\(#([^)]+)\)", rf"url(#{prefix}-\1)", text)
    text = re.sub(r'xlink:href="#([^"]+)"', rf'xlink:href="#{prefix}-\1"', text)
    # Fault markers get a class and their number, so a page's CSS and a test can find
    # them whatever figure they are in (matplotlib writes a gid as a bare id).
    text = re.sub(r'<g id="([\w-]+-)?fault-(marker|converged|label)-(\d+)"',
                  r'<g id="\1fault-\2-\3" class="fault-\2" data-fault="\3"', text)
    label = label.replace("&", "&amp;").replace('"', "&quot;").replace("<", "&lt;")
    return text.replace("<svg", f'<svg role="img" aria-label="{label}"', 1)


def draw_faults(ax: Any, faults: Sequence[FaultMark], scale: float, lo_ns: float,
                hi_ns: float) -> None:
    """Vertical lines at the faults inside [lo_ns, hi_ns] (the axes' span, fabric ns),
    numbered at the top of the axes, and a key under the axes naming them.

    Applied faults are solid, their reconvergence dashed and lighter. Labels take
    one of three heights so close faults stay readable; a fault with no free height
    keeps its line and its number in the key. Lines carry the gids
    `fault-marker-N` / `fault-converged-N` (`fault-label-N` for the number)."""
    if not faults:
        return
    span = max(hi_ns - lo_ns, 1e-9)
    inside = [f for f in faults if lo_ns <= f.ts_fabric_ns <= hi_ns]
    last_at = [-1.0] * _LABEL_ROWS
    for f in sorted(inside, key=lambda f: (f.ts_fabric_ns, f.converged, f.number)):
        x = f.ts_fabric_ns / scale
        line = ax.axvline(x, color=FAULT_COLOR, zorder=4,
                          linewidth=1.0 if f.converged else 1.4,
                          alpha=0.45 if f.converged else 0.9,
                          linestyle=(0, (3, 2)) if f.converged else "-")
        line.set_gid(f"fault-{'converged' if f.converged else 'marker'}-{f.number}")
        if f.converged:
            continue
        where = (f.ts_fabric_ns - lo_ns) / span
        row = next((r for r in range(_LABEL_ROWS) if where - last_at[r] >= _LABEL_GAP), None)
        if row is None:
            continue
        last_at[row] = where
        label = ax.text(x, 0.985 - 0.085 * row, str(f.number), ha="center", va="top",
                        transform=ax.get_xaxis_transform(), fontsize=8, color=FAULT_COLOR,
                        zorder=6, fontweight="bold",
                        bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": FAULT_COLOR,
                              "lw": 0.8, "alpha": 0.9})
        label.set_gid(f"fault-label-{f.number}")
    applied = sorted({(f.number, f.text) for f in inside if not f.converged})
    outside = {f.number for f in faults if not f.converged} - {n for n, _ in applied}
    if applied and len(applied) <= MAX_FAULT_KEY:
        parts = [f"{n} {plain(_short(t))}" if t else str(n) for n, t in applied]
        lines = ["   ".join(parts[i:i + 3]) for i in range(0, len(parts), 3)]
        key = "faults: " + "\n".join(lines)
    elif applied:
        key = (f"faults {applied[0][0]}-{applied[-1][0]} ({len(applied)}): "
               "see the fault timeline")
    else:
        key = ""
    if outside:
        key += ("; " if key else "") + f"{len(outside)} outside this plot's time span"
    if key:
        ax.annotate(key, xy=(0.0, 0.0), xycoords="axes fraction", xytext=(0, -36),
                    textcoords="offset points", ha="left", va="top", fontsize=8.5,
                    color=FAULT_COLOR)


def _short(text: str, limit: int = 44) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _draw_annotations(ax: Any, annotations: Sequence[Annotation], scale: float,
                      y_divisor: float) -> None:
    """Arrows to the points the caller names (where a fault hit, where the failure shows).

    The texts sit inside the axes, below the fault numbers and at two heights, beside
    their point (to its left in the right part of the plot), so they cover neither the
    tick labels nor each other."""
    lo, hi = ax.get_xlim()
    for i, a in enumerate(annotations):
        x = a.ts_fabric_ns / scale
        where = (x - lo) / (hi - lo) if hi > lo else 0.0
        right = where > 0.6
        note = ax.annotate(
            plain(a.text), xy=(x, a.value / y_divisor),
            xytext=(where - 0.03 if right else where + 0.03, 0.62 if i % 2 == 0 else 0.42),
            textcoords="axes fraction", ha="right" if right else "left", va="center",
            fontsize=9, color="#1b1f24", zorder=7,
            arrowprops={"arrowstyle": "->", "color": "#1b1f24", "lw": 1.0},
            bbox={"boxstyle": "round,pad=0.25", "fc": "#fff8c5", "ec": "#bf8700", "lw": 0.8})
        note.set_gid(f"evidence-annotation-{i + 1}")


def line_plot(series: Sequence[Series], prefix: str, title: str, ylabel: str, y_divisor: float,
              x_max_ns: float, hlines: Sequence[tuple[float, str]] = (),
              ymin_zero: bool = True, faults: Sequence[FaultMark] = (),
              annotations: Sequence[Annotation] = ()) -> str:
    """One axes, up to 8 series over fabric time; hlines = (value before y_divisor, label).

    Every series is a step function (docs/run-format.md): a value holds from its point
    until the next one, so it is drawn as steps, never as a line between two points.
    `faults` are drawn as numbered vertical lines (draw_faults), `annotations` as arrows.
    """
    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=(10.5, 3.8))
        ax = fig.add_subplot()
        scale, unit = time_unit(x_max_ns)
        for i, s in enumerate(series):
            pts = reduce_points(s.points)
            xs = [t / scale for t, _ in pts]
            ys = [v / y_divisor for _, v in pts]
            color = SERIES_COLORS[i % len(SERIES_COLORS)]
            ax.step(xs, ys, where="post", label=plain(s.label), color=color)
        for j, (value, text) in enumerate(hlines):
            ax.axhline(value / y_divisor, color="#555555", linestyle=(0, (4, 3)), linewidth=1)
            ax.annotate(text, xy=(0.0, value / y_divisor), xycoords=("axes fraction", "data"),
                        xytext=(4, 3 if j % 2 == 0 else -12), textcoords="offset points",
                        fontsize=9, color="#333333", zorder=5,
                        bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none",
                              "alpha": 0.85})
        ax.set_title(plain(title), loc="left")
        ax.set_xlabel(f"fabric time ({unit})")
        ax.set_ylabel(ylabel)
        x_min_ns = min([0, *(s.points[0][0] for s in series if s.points)])
        ax.set_xlim(x_min_ns / scale, max(x_max_ns / scale, 1e-9))
        if ymin_zero:
            ax.set_ylim(bottom=0)
        draw_faults(ax, faults, scale, x_min_ns, max(x_max_ns, 1e-9 * scale))
        _draw_annotations(ax, annotations, scale, y_divisor)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        return _svg(fig, prefix, title)


#: A timeline bar: (start_ns, duration_ns), or with a category that picks its colour.
Bar = tuple[int, int] | tuple[int, int, str]


def timeline_plot(rows: Sequence[tuple[str, Sequence[Bar]]], prefix: str,
                  title: str, x_max_ns: float, x_min_ns: float = 0.0,
                  categories: Sequence[str] = (), faults: Sequence[FaultMark] = ()) -> str:
    """Broken-bar timeline: one row per label, bars = (start_ns, duration_ns[, category]).

    Bars without a category are drawn in one colour. Bars with one are coloured by it,
    with a legend: the categories in the order of `categories`, then any other in the
    order first met. The x axis runs from `x_min_ns` to `x_max_ns` (fabric time);
    `faults` are drawn on it as numbered vertical lines (draw_faults)."""
    order = list(dict.fromkeys([*categories, *(b[2] for _, bars in rows for b in bars
                                               if len(b) > 2)]))
    color_of = {c: SERIES_COLORS[i % len(SERIES_COLORS)] for i, c in enumerate(order)}
    with matplotlib.rc_context(_RC):
        height = 1.2 + 0.38 * len(rows)
        fig = Figure(figsize=(10.5, height))
        ax = fig.add_subplot()
        scale, unit = time_unit(x_max_ns)
        # a bar too short to see is drawn 1/800 of the axis wide
        least = (x_max_ns - x_min_ns) / scale / 800
        for i, (_, bars) in enumerate(rows):
            spans = [(b[0] / scale, max(b[1] / scale, least)) for b in bars]
            colors = [color_of[b[2]] if len(b) > 2 else SERIES_COLORS[1] for b in bars]
            ax.broken_barh(spans, (i - 0.35, 0.7), facecolors=colors, alpha=0.85)
        ax.set_yticks(range(len(rows)), [plain(label) for label, _ in rows])
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.set_xlim(x_min_ns / scale, max(x_max_ns / scale, x_min_ns / scale + 1e-9))
        ax.set_xlabel(f"fabric time ({unit})")
        ax.set_title(plain(title), loc="left")
        ax.grid(axis="y", visible=False)
        draw_faults(ax, faults, scale, x_min_ns, max(x_max_ns, x_min_ns + 1e-9 * scale))
        used = [c for c in order if any(len(b) > 2 and b[2] == c for _, bs in rows for b in bs)]
        if used:
            handles = [Patch(facecolor=color_of[c], alpha=0.85, label=plain(c)) for c in used]
            ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                      frameon=False)
        return _svg(fig, prefix, title)


# --- the fabric drawing -------------------------------------------------------------------

_TIER_NAMES = {0: "hosts", 1: "leaves", 2: "spines", 3: "super-spines"}
_NODE_COLORS = {0: ("#fde0c5", "#c9753d"), 1: ("#d3ecd5", "#3f8f4a"), 2: ("#d6e4f5", "#3a6ea5")}
_OTHER_COLORS = ("#e8def3", "#6b4f96")
_RATE_COLORS = ["#7fa8d4", "#3a6ea5", "#163d6b", "#5b2a86", "#000000"]
_LABEL_COLOR = "#1f456e"
_MARGINAL_COLOR = "#d62728"


def fabric_layers(plan: Plan) -> dict[str, int] | None:
    """Tier of each node (hosts 0, leaves 1, spines 2, ...), or None when not layered.

    Switches attached to a host are leaves, switches one hop above them spines,
    and so on. A link between two switches of the same tier (a ring, a mesh)
    means there are no clean layers: the caller draws a circle instead.
    """
    adjacency: dict[str, set[str]] = {n.name: set() for n in plan.nodes}
    for link in plan.links:
        adjacency.setdefault(link.a.node, set()).add(link.b.node)
        adjacency.setdefault(link.b.node, set()).add(link.a.node)
    frontier = sorted(n.name for n in plan.hosts())
    if not frontier:
        return None
    layer = {name: 0 for name in frontier}
    while frontier:
        following = []
        for u in frontier:
            for v in sorted(adjacency[u]):
                if v not in layer:
                    layer[v] = layer[u] + 1
                    following.append(v)
        frontier = following
    top = max(layer.values())
    for name in adjacency:
        layer.setdefault(name, top + 1)
    for link in plan.links:
        if layer[link.a.node] == layer[link.b.node]:
            return None
    return layer


def _layered_positions(plan: Plan, layer: dict[str, int]) -> dict[str, tuple[float, float]]:
    adjacency: dict[str, list[str]] = {n.name: [] for n in plan.nodes}
    for link in plan.links:
        adjacency[link.a.node].append(link.b.node)
        adjacency[link.b.node].append(link.a.node)
    pos: dict[str, tuple[float, float]] = {}
    leaves = sorted((n for n, t in layer.items() if t == 1), key=natural_key)
    hosts_in_order: list[str] = []
    for leaf in leaves:
        for h in sorted(adjacency[leaf], key=natural_key):
            if layer[h] == 0 and h not in hosts_in_order:
                hosts_in_order.append(h)
    hosts_in_order += sorted((n for n, t in layer.items() if t == 0 and n not in hosts_in_order),
                             key=natural_key)
    for i, h in enumerate(hosts_in_order):
        pos[h] = (float(i), 0.0)
    lo, hi = 0.0, float(max(len(hosts_in_order) - 1, 1))
    for tier in range(1, max(layer.values()) + 1):
        names = [n for n, t in layer.items() if t == tier]

        def below(n: str, tier: int = tier) -> list[float]:
            return [pos[m][0] for m in adjacency[n] if layer[m] == tier - 1 and m in pos]

        if tier == 1:
            for n in names:
                xs = below(n)
                pos[n] = (sum(xs) / len(xs) if xs else hi, float(tier))
            continue
        names.sort(key=lambda n: (sum(below(n)) / max(len(below(n)), 1), natural_key(n)))
        for i, n in enumerate(names):
            x = (lo + hi) / 2 if len(names) == 1 else lo + (hi - lo) * i / (len(names) - 1)
            pos[n] = (x, float(tier))
    return pos


def _circle_positions(plan: Plan) -> dict[str, tuple[float, float]]:
    """Switches on a circle in walk order (a ring stays a ring), hosts outside their switch."""
    switches = sorted((n.name for n in plan.switches()), key=natural_key)
    hosts = {n.name for n in plan.hosts()}
    neighbours: dict[str, list[str]] = {n.name: [] for n in plan.nodes}
    for link in plan.links:
        neighbours[link.a.node].append(link.b.node)
        neighbours[link.b.node].append(link.a.node)
    order: list[str] = []
    for start in switches:
        stack = [start]
        while stack:
            u = stack.pop()
            if u in order:
                continue
            order.append(u)
            nxt = sorted((v for v in neighbours[u] if v not in hosts and v not in order),
                         key=natural_key, reverse=True)
            stack.extend(nxt)
    if not order:                       # hosts only (back to back)
        order = sorted(hosts, key=natural_key)
        hosts = set()
    pos: dict[str, tuple[float, float]] = {}
    angle: dict[str, float] = {}
    first = math.pi if len(order) == 2 else math.pi / 2     # two switches side by side
    for i, name in enumerate(order):
        a = first - 2 * math.pi * i / len(order)
        angle[name] = a
        pos[name] = (math.cos(a), math.sin(a))
    # Hosts sit outside the switch they hang off; a host homed to switches on
    # opposite sides sits inside the circle, between them.
    groups: dict[tuple[str, ...], list[str]] = {}
    for h in sorted(hosts, key=natural_key):
        anchor = tuple(sorted((v for v in neighbours[h] if v in angle), key=order.index))
        groups.setdefault(anchor, []).append(h)
    spare = 0
    for anchor, members in groups.items():
        if not anchor:
            for h in members:
                pos[h] = (-2.2, 1.0 - 0.3 * spare)
                spare += 1
            continue
        vx = sum(math.cos(angle[s]) for s in anchor) / len(anchor)
        vy = sum(math.sin(angle[s]) for s in anchor) / len(anchor)
        if math.hypot(vx, vy) >= 0.3:
            base, radius = math.atan2(vy, vx), 1.75
        else:
            base, radius = angle[anchor[0]] - math.pi / 2, 0.7
        for j, h in enumerate(members):
            a = base + (j - (len(members) - 1) / 2) * 0.3
            pos[h] = (radius * math.cos(a), radius * math.sin(a))
    return pos


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}es" if noun.endswith("ch") else f"{n} {noun}s"


def fabric_plot(plan: Plan, prefix: str = "fabric") -> str:
    """Nodes and links, link rates in fabric units; leaf-spine layers or a circle."""
    layer = fabric_layers(plan)
    layered = layer is not None
    roles = {n.name: n.role for n in plan.nodes}
    if layer is not None:
        pos, tiers = _layered_positions(plan, layer), layer
    else:
        pos = _circle_positions(plan)
        tiers = {n: 0 if r == "host" else 1 for n, r in roles.items()}
    rates = sorted({link.rate_bps for link in plan.links})
    color_of = {r: _RATE_COLORS[min(i, len(_RATE_COLORS) - 1)] for i, r in enumerate(rates)}
    width_of = {r: 1.3 + 1.1 * i for i, r in enumerate(rates)}
    n_hosts = sum(1 for r in roles.values() if r == "host")
    with matplotlib.rc_context(_RC):
        if layered:
            n_tiers = max(tiers.values()) + 1
            fig = Figure(figsize=(10.5, 1.5 * n_tiers + 1.0))
        else:
            fig = Figure(figsize=(8.0, 7.0))
        ax = fig.add_subplot()
        ax.set_axis_off()
        label_links = len(plan.links) <= 48
        for link in plan.links:
            (xa, ya), (xb, yb) = pos[link.a.node], pos[link.b.node]
            if layered and ya > yb:
                (xa, ya), (xb, yb) = (xb, yb), (xa, ya)
            marginal = bool(link.phy_warnings)
            color = _MARGINAL_COLOR if marginal else color_of[link.rate_bps]
            ax.plot([xa, xb], [ya, yb], color=color, linewidth=width_of[link.rate_bps],
                    linestyle=(0, (5, 3)) if marginal else "-", zorder=1, solid_capstyle="round")
            if label_links:
                host_link = tiers[link.a.node] == 0 or tiers[link.b.node] == 0
                t = 0.5 if host_link or not layered else 0.25
                ax.text(xa + t * (xb - xa), ya + t * (yb - ya), short_rate(link.rate_bps),
                        fontsize=8.5, ha="center", va="center", zorder=2,
                        color=_MARGINAL_COLOR if marginal else _LABEL_COLOR,
                        bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none",
                              "alpha": 0.9})
        small = n_hosts > 16
        for name, (x, y) in pos.items():
            tier = tiers[name]
            fc, ec = _NODE_COLORS.get(tier, _OTHER_COLORS) if layered else (
                _NODE_COLORS[0] if tier == 0 else _NODE_COLORS[1])
            is_host = roles.get(name) == "host"
            ax.text(x, y, plain(name), ha="center", va="center", zorder=3,
                    fontsize=8.5 if (small and is_host) else 10.5,
                    rotation=90 if (is_host and n_hosts > 24 and layered) else 0,
                    fontweight="normal" if is_host else "bold",
                    bbox={"boxstyle": "round,pad=0.4", "fc": fc, "ec": ec, "lw": 1.2})
        xs = [p[0] for p in pos.values()]
        ys = [p[1] for p in pos.values()]
        if layered:
            left = min(xs) - 0.9
            for tier in sorted(set(tiers.values())):
                ax.text(left, tier, _TIER_NAMES.get(tier, f"tier {tier}"), ha="right",
                        va="center", fontsize=10, color="#555555", style="italic")
            ax.set_xlim(left - 1.2, max(xs) + 0.8)
            ax.set_ylim(min(ys) - 0.45, max(ys) + 0.45)
        else:
            ax.set_xlim(min(xs) - 0.5, max(xs) + 0.5)
            ax.set_ylim(min(ys) - 0.4, max(ys) + 0.4)
            ax.set_aspect("equal")
        handles = []
        for r in rates:
            links = [link for link in plan.links if link.rate_bps == r]
            types = ", ".join(sorted({link.port_type for link in links}))
            label = f"{short_rate(r)} × {_count(len(links), 'link')} ({types})"
            handles.append(Line2D([], [], color=color_of[r], linewidth=width_of[r], label=label))
        if any(link.phy_warnings for link in plan.links):
            handles.append(Line2D([], [], color=_MARGINAL_COLOR, linestyle=(0, (5, 3)),
                                  linewidth=2, label="link with PHY warnings"))
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False,
                  title="link rate (fabric)")
        n_sw = len(roles) - n_hosts
        ax.set_title(f"fabric {plan.lab}: {_count(n_hosts, 'host')}, {_count(n_sw, 'switch')}, "
                     f"{_count(len(plan.links), 'link')}", loc="left")
        return _svg(fig, prefix, f"fabric drawing of lab {plan.lab}")


@dataclass(frozen=True)
class XYLine:
    """One line of xy_plot: points (x, y), its colour (SERIES_COLORS index), its dash."""

    label: str
    points: Sequence[tuple[float, float]]
    color: int = 0
    linestyle: str = "-"
    marker: str | None = None


def xy_plot(lines: Sequence[XYLine], prefix: str, title: str, xlabel: str, ylabel: str, *,
            log_x: bool = False, log_y: bool = False, steps: bool = False,
            x_divisor: float = 1.0) -> str:
    """One axes of lines over anything but time (FCT CDFs, slowdown by flow size); `steps`
    draws a CDF as the step function it is (each value holds up to the next)."""
    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=(10.5, 3.8))
        ax = fig.add_subplot()
        for line in lines:
            xs = [x / x_divisor for x, _ in line.points]
            ys = [y for _, y in line.points]
            color = SERIES_COLORS[line.color % len(SERIES_COLORS)]
            if steps:
                ax.step(xs, ys, where="post", label=plain(line.label), color=color,
                        linestyle=line.linestyle)
            else:
                ax.plot(xs, ys, label=plain(line.label), color=color, linestyle=line.linestyle,
                        marker=line.marker, markersize=4)
        if log_x:
            ax.set_xscale("log")
        if log_y:
            ax.set_yscale("log")
        ax.set_title(plain(title), loc="left")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        return _svg(fig, prefix, title)
