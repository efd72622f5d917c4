"""A catalogue of damages to a run directory, for the readers' hardening tests.

Each damage is (name, apply(run_dir)); apply edits the copy in place the way
an engineer editing a run directory, a full disk or a killed writer would:
files missing, truncated, not JSON / not SQLite, wrong types, NaN / inf /
negative numbers, a dropped table, bad JSON in a table, text in a sample
value, metadata that disagrees with the summary.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from pathlib import Path

FILES = ("summary.json", "metadata.json", "plan.json", "counters.sqlite")


def _edit_json(name: str, edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(run_dir: Path) -> None:
        path = run_dir / name
        data = json.loads(path.read_text())
        edit(data)
        path.write_text(json.dumps(data))     # json.dumps writes NaN / Infinity as Python does
    return apply


def _sql(*statements: str) -> Callable[[Path], None]:
    def apply(run_dir: Path) -> None:
        db = sqlite3.connect(run_dir / "counters.sqlite")
        try:
            for s in statements:
                db.execute(s)
            db.commit()
        finally:
            db.close()
        for tail in ("-wal", "-shm"):
            (run_dir / f"counters.sqlite{tail}").unlink(missing_ok=True)
    return apply


def _missing(name: str) -> Callable[[Path], None]:
    return lambda d: (d / name).unlink()


def _truncated(name: str) -> Callable[[Path], None]:
    def apply(run_dir: Path) -> None:
        path = run_dir / name
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    return apply


def _replace(name: str, content: bytes) -> Callable[[Path], None]:
    return lambda d: (d / name).write_bytes(content)


def _set(key: str, value: object) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        data[key] = value
    return edit


def _drop(key: str) -> Callable[[dict], None]:
    return lambda data: data.pop(key, None)


def _first_port(field: str, value: object) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        data["ports"][0][field] = value
    return edit


def _totals(field: str, value: object) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        data.setdefault("totals", {})[field] = value
    return edit


DAMAGES: list[tuple[str, Callable[[Path], None]]] = []
for _name in FILES:
    _stem = _name.split(".")[0]
    DAMAGES += [
        (f"{_stem}-missing", _missing(_name)),
        (f"{_stem}-truncated", _truncated(_name)),
        (f"{_stem}-empty", _replace(_name, b"")),
        (f"{_stem}-garbage", _replace(_name, b"\x00\xffnot what it should be\x80" * 20)),
    ]
for _name in ("summary.json", "metadata.json", "plan.json"):
    _stem = _name.split(".")[0]
    DAMAGES += [
        (f"{_stem}-a-list", _replace(_name, b"[1, 2, 3]")),
        (f"{_stem}-format-version-text", _edit_json(_name, _set("format_version", "two"))),
    ]
DAMAGES += [
    ("summary-no-ports", _edit_json("summary.json", _drop("ports"))),
    ("summary-ports-a-string", _edit_json("summary.json", _set("ports", "none"))),
    ("summary-port-text-value", _edit_json("summary.json", _first_port("tx_bytes", "lots"))),
    ("summary-port-nan", _edit_json("summary.json", _first_port("drops", float("nan")))),
    ("summary-port-inf", _edit_json("summary.json", _first_port("ecn_marks", float("inf")))),
    ("summary-port-negative", _edit_json("summary.json", _first_port("max_queue_bytes", -5))),
    ("summary-dilation-zero", _edit_json("summary.json", _set("dilation", 0))),
    ("summary-dilation-text", _edit_json("summary.json", _set("dilation", "fast"))),
    ("summary-dilation-negative", _edit_json("summary.json", _set("dilation", -3))),
    ("summary-dilation-disagrees", _edit_json("summary.json", _set("dilation", 7))),
    ("summary-no-dilation", _edit_json("summary.json", _drop("dilation"))),
    ("summary-duration-nan", _edit_json("summary.json", _set("duration_wall_s", float("nan")))),
    ("summary-duration-inf", _edit_json("summary.json",
                                        _set("duration_fabric_ns", float("inf")))),
    ("summary-duration-negative", _edit_json("summary.json", _set("duration_wall_s", -1.0))),
    ("summary-duration-text", _edit_json("summary.json", _set("duration_fabric_ns", "long"))),
    ("summary-no-durations", lambda d: (_edit_json("summary.json", _drop("duration_wall_s"))(d),
                                        _edit_json("summary.json",
                                                   _drop("duration_fabric_ns"))(d))),
    ("summary-workloads-a-dict", _edit_json("summary.json", _set("workloads", {"a": 1}))),
    ("summary-workload-rows-text", _edit_json(
        "summary.json", _set("workloads", [{"name": "w", "kind": "udp", "results": "x"}]))),
    ("summary-totals-a-list", _edit_json("summary.json", _set("totals", [1]))),
    ("summary-totals-nan", _edit_json("summary.json", _totals("delivered_bytes", float("nan")))),
    ("summary-totals-text", _edit_json("summary.json", _totals("drops", "many"))),
    ("summary-links-a-string", _edit_json("summary.json", _set("links", "l"))),
    ("summary-fidelity-a-dict", _edit_json("summary.json", _set("fidelity", {"x": 1}))),
    ("summary-verdict-a-list", _edit_json("summary.json", _set("verdict", [1]))),
    ("summary-collector-a-string", _edit_json("summary.json", _set("collector", "c"))),
    ("metadata-dilation-text", _edit_json("metadata.json", _set("dilation", "x"))),
    ("metadata-probe-a-list", _edit_json("metadata.json", _set("probe", [1]))),
    ("plan-wrong-type", _edit_json("plan.json", _set("dilation", "x"))),
    ("counters-events-bad-json", _sql("UPDATE events SET detail = '{not json'")),
    ("counters-events-json-list", _sql("UPDATE events SET detail = '[1]'")),
    ("counters-results-bad-json", _sql("UPDATE results SET row = 'nope{'")),
    ("counters-results-json-list", _sql("UPDATE results SET row = '[1, 2]'")),
    ("counters-points-text-value", _sql("UPDATE points SET value = 'abc' WHERE series_id = "
                                        "(SELECT MIN(series_id) FROM points)")),
    ("counters-points-inf", _sql("UPDATE points SET value = 9e999 WHERE series_id = "
                                 "(SELECT MIN(series_id) FROM points)")),
    ("counters-points-negative", _sql("UPDATE points SET value = -1 WHERE series_id = "
                                      "(SELECT MIN(series_id) FROM points)")),
    ("counters-tclass-text", _sql("UPDATE series SET tclass = 'x' WHERE id = "
                                  "(SELECT MIN(id) FROM series)")),
    ("counters-ts-text", _sql("UPDATE events SET ts_fabric_ns = 'soon'")),
    ("counters-meta-dilation-text", _sql("UPDATE meta SET value = 'x' WHERE key = 'dilation'")),
    ("counters-meta-version-text", _sql("UPDATE meta SET value = 'x' "
                                        "WHERE key = 'format_version'")),
    ("counters-drop-events", _sql("DROP TABLE events")),
    ("counters-drop-results", _sql("DROP TABLE results")),
    ("counters-drop-points", _sql("DROP TABLE points")),
    ("counters-drop-series", _sql("DROP TABLE series")),
    ("counters-drop-sample-times", _sql("DROP TABLE sample_times")),
    ("counters-drop-meta", _sql("DROP TABLE meta")),
    ("counters-flows-bad-extra", _sql(
        "INSERT INTO flows VALUES ('w', 1, 'h1', 'h2', '10.0.0.1', '10.0.0.2', 1, 2, 100, 0, "
        "10, 5, 2.0, 3, '{bad')")),
    ("counters-flows-text-size", _sql(
        "INSERT INTO flows VALUES ('w', 1, 'h1', 'h2', '10.0.0.1', '10.0.0.2', 1, 2, 'big', 0, "
        "10, 5, 2.0, 3, '{}')")),
]
