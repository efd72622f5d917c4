"""Final counters of a run in the Prometheus text exposition format (version 0.0.4).

Meant for node_exporter's textfile collector: the file is written next to
its destination as `NAME.tmp` (which the collector ignores) and renamed into
place, so a scrape never sees half a file. Values are the summary's totals
over the whole run, in fabric units (bytes are bytes; the one time metric
is fabric seconds and says so in its name).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from testbed.results.files import write_atomic

# (metric, type, summary port field, scale, help)
PORT_METRICS = [
    ("testbed_port_tx_bytes_total", "counter", "tx_bytes", 1,
     "Bytes sent by an egress port and traffic class over the run."),
    ("testbed_port_tx_packets_total", "counter", "tx_packets", 1,
     "Packets sent by an egress port and traffic class over the run."),
    ("testbed_port_drops_total", "counter", "drops", 1,
     "Packets dropped by an egress port and traffic class over the run."),
    ("testbed_port_ecn_marks_total", "counter", "ecn_marks", 1,
     "Packets marked CE by an egress port and traffic class over the run."),
    ("testbed_port_trims_total", "counter", "trims", 1,
     "UET packets an egress port and traffic class trimmed (cut and sent on in the trim "
     "class instead of dropped) over the run."),
    ("testbed_port_max_queue_bytes", "gauge", "max_queue_bytes", 1,
     "Largest sampled backlog of an egress port and traffic class."),
    ("testbed_pfc_pause_tx_total", "counter", "pause_tx", 1,
     "PFC pause frames sent out of a port for a priority."),
    ("testbed_pfc_pause_rx_total", "counter", "pause_rx", 1,
     "PFC pause frames received on a port for a priority."),
    ("testbed_pfc_paused_fabric_seconds_total", "counter", "paused_ns", 1e-9,
     "Fabric time an egress port and traffic class spent paused by PFC."),
]


def escape_label(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float | int | bool) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def _labels(labels: Mapping[str, object]) -> str:
    return "{" + ",".join(f'{k}="{escape_label(v)}"' for k, v in labels.items()) + "}"


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str,
               samples: Sequence[tuple[Mapping[str, object], float]]) -> None:
        if not samples:
            return
        self.lines.append(f"# HELP {name} {escape_help(help_text)}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            self.lines.append(f"{name}{_labels(labels)} {format_value(value)}")


def prometheus_text(summary: dict, metadata: dict | None = None, incomplete: bool = False,
                    reader_notes: int = 0) -> str:
    """The exposition text for one run's summary."""
    metadata = metadata or {}
    lab = str(summary.get("lab", ""))
    w = _Writer()
    probe = metadata.get("probe")
    if not isinstance(probe, dict):
        probe = {}
    w.family("testbed_run_info", "gauge", "The run this file describes (value is always 1).",
             [({"lab": lab, "name": summary.get("name", ""),
                "testbed_version": metadata.get("testbed_version", ""),
                "kernel": metadata.get("kernel") or probe.get("kernel") or ""}, 1)])
    run = {"lab": lab}
    w.family("testbed_run_dilation", "gauge",
             "Time dilation D: the fabric ran D times slower than real time.",
             [(run, int(summary.get("dilation") or 1))])
    w.family("testbed_run_interrupted", "gauge", "1 if the run was interrupted before it finished.",
             [(run, bool(summary.get("interrupted")))])
    w.family("testbed_run_incomplete", "gauge",
             "1 if summary.json was missing and the totals were rebuilt from counters.sqlite.",
             [(run, bool(incomplete))])
    # A duration the reader found missing or bad is None: no sample, not a made-up 0.
    if summary.get("duration_fabric_ns") is not None:
        w.family("testbed_run_duration_fabric_seconds", "gauge",
                 "Duration of the run in fabric time.",
                 [(run, summary["duration_fabric_ns"] / 1e9)])
    if summary.get("duration_wall_s") is not None:
        w.family("testbed_run_duration_wall_seconds", "gauge", "Duration of the run in wall time.",
                 [(run, float(summary["duration_wall_s"]))])
    w.family("testbed_run_fidelity_notes", "gauge",
             "Number of places where the run could not keep fabric fidelity.",
             [(run, len(summary.get("fidelity") or []))])
    w.family("testbed_run_reader_notes", "gauge",
             "Number of files or fields of the run directory that were missing, damaged or "
             "inconsistent (the HTML report's notes name them).",
             [(run, reader_notes)])
    delivered = (summary.get("totals") or {}).get("delivered_bytes")
    if delivered is not None:
        w.family("testbed_run_delivered_bytes_total", "counter",
                 "Bytes delivered to the workload's receivers over the run.", [(run, delivered)])
    ports = [p for p in summary.get("ports") or [] if isinstance(p, dict)]
    for name, kind, field, scale, help_text in PORT_METRICS:
        samples = []
        for p in ports:
            if field not in p:
                continue
            value = p[field] or 0
            samples.append(({"lab": lab, "node": p.get("node", ""), "port": p.get("port", ""),
                             "tclass": p.get("tclass", -1)},
                            value * scale if scale != 1 else value))
        w.family(name, kind, help_text, samples)
    return "\n".join(w.lines) + "\n"


def write_text_file(out: Path, text: str, mode: int) -> None:
    """Textfile-collector style: write `out.tmp`, then rename it over `out`."""
    write_atomic(out, text, mode)
