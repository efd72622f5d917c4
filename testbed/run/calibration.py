"""This machine's calibration file: what `testbed calibrate` measured for `dilation: auto`,
and the derating the runs taught it.

/var/lib/testbed/calibration.json (or $TESTBED_CALIBRATION), format 2 (docs/dilation.md):

    {"format": 2,
     "max_wall_port_rate_bps": ..., "aggregate_wall_bps": ..., "hosts": ..., "trials": [...],
     "measured_unix": ...,                     # the per-port budget, as format 1 had it
     "capacity": {"hop_pps_per_core": ..., "cores": ...,
                  "agents": {"udp": {"send_core_s": ..., "recv_core_s": ...}, "roce": ...},
                  "measured_unix": ..., "trials": [...], "notes": [...]},
     "derating": {"<machine>": {"scale": ..., "clean_runs": ..., "runs": ...,
                                "fell_behind_runs": ..., "updated_unix": ..., "last": ...}}}

A format 1 file (no "format": only the per-port budget) still loads: its budget is used
where a budget is asked for, and the capacity is the default. The derating is kept per
machine (its host name), so a file copied to another machine does not carry it over.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from agents.timebase import machine_slowdown
from testbed.plan import DEFAULT_MAX_WALL_PORT_RATE_BPS
from testbed.plan.capacity import DEFAULT_CAPACITY, AgentCost, Capacity, Derating, learn

CALIBRATION_FORMAT = 2


class CalibrationError(ValueError):
    """A calibration file this testbed cannot read (a newer format, a broken field)."""


def calibration_path() -> Path:
    return Path(os.environ.get("TESTBED_CALIBRATION", "/var/lib/testbed/calibration.json"))


def machine_name() -> str:
    """What the derating is kept under: this machine's host name."""
    return socket.gethostname() or "localhost"


def read_calibration(path: Path) -> dict:
    """The file's data; {} when there is none. CalibrationError when it cannot be used."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot read: {exc}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise CalibrationError(f"{path}: not JSON ({exc}); run `testbed calibrate` to "
                               "write it again") from None
    if not isinstance(data, dict):
        raise CalibrationError(f"{path}: not a JSON object; run `testbed calibrate`")
    version = data.get("format", 1)
    if not isinstance(version, int) or version > CALIBRATION_FORMAT:
        raise CalibrationError(f"{path}: format {version!r} is newer than this testbed reads "
                               f"({CALIBRATION_FORMAT}); upgrade it or run `testbed calibrate`")
    return data


def load_budget_bps() -> tuple[int, str]:
    """(budget, where it came from): the calibrated per-port figure, or the conservative
    default."""
    path = calibration_path()
    try:
        data = read_calibration(path)
        return int(data["max_wall_port_rate_bps"]), f"calibrated ({path})"
    except (CalibrationError, ValueError, KeyError, TypeError):
        pass
    slowdown = machine_slowdown()
    if slowdown > 1:
        # A slow machine (a TCG guest) carries far less: scale the default down with it.
        return (int(DEFAULT_MAX_WALL_PORT_RATE_BPS / slowdown),
                f"default for a machine {slowdown:g}x slower (run `testbed calibrate"
                f"{' --vm' if os.environ.get('TESTBED_VM') == '1' else ''}` to measure)")
    return DEFAULT_MAX_WALL_PORT_RATE_BPS, "default (run `testbed calibrate` to measure)"


def capacity_from(data: dict, path: Path, machine: str, slowdown: float = 1.0) -> Capacity:
    """The capacity a calibration file's data gives (pure): its measured figures, or the
    default (scaled down on a slow machine), with the machine's derating applied."""
    measured = data.get("capacity")
    if isinstance(measured, dict):
        try:
            agents = {k: AgentCost(float(v["send_core_s"]), float(v["recv_core_s"]))
                      for k, v in measured["agents"].items()
                      if isinstance(v, dict) and "send_core_s" in v}
            for kind, cost in DEFAULT_CAPACITY.agents.items():
                agents.setdefault(kind, cost)
            cap = Capacity(hop_pps_per_core=float(measured["hop_pps_per_core"]),
                           cores=int(measured["cores"]), agents=agents,
                           source=f"calibrated ({path})")
        except (KeyError, TypeError, ValueError) as exc:
            raise CalibrationError(f"{path}: capacity: {exc!r} is missing or not a number; "
                                   "run `testbed calibrate` to measure again") from None
        if cap.hop_pps_per_core <= 0 or cap.cores < 1:
            raise CalibrationError(f"{path}: capacity: hop_pps_per_core and cores must be "
                                   "positive; run `testbed calibrate`")
    elif slowdown > 1:
        cap = Capacity(hop_pps_per_core=DEFAULT_CAPACITY.hop_pps_per_core / slowdown,
                       cores=1, agents={k: AgentCost(a.send_core_s * slowdown,
                                                     a.recv_core_s * slowdown)
                                        for k, a in DEFAULT_CAPACITY.agents.items()},
                       source=f"default for a machine {slowdown:g}x slower (run `testbed "
                              "calibrate` to measure)")
    else:
        why = "" if not data else "; the file has only a per-port budget (format 1)"
        cap = Capacity(DEFAULT_CAPACITY.hop_pps_per_core, DEFAULT_CAPACITY.cores,
                       DEFAULT_CAPACITY.agents,
                       source=f"default (run `testbed calibrate` to measure{why})")
    derating = derating_of(data, machine)
    if derating.scale < 1.0:
        note = (f"derated to {derating.scale:g} of the measured capacity: "
                f"{derating.fell_behind_runs} of {derating.runs} runs at a D the capacity "
                "allowed had a port or sender fall behind")
        cap = Capacity(cap.hop_pps_per_core, cap.cores, cap.agents, cap.source,
                       derating.scale, note)
    return cap


def derating_of(data: dict, machine: str) -> Derating:
    entry = (data.get("derating") or {}).get(machine)
    if not isinstance(entry, dict):
        return Derating()
    try:
        return Derating(float(entry["scale"]), int(entry.get("clean_runs", 0)),
                        int(entry.get("runs", 0)), int(entry.get("fell_behind_runs", 0)))
    except (KeyError, TypeError, ValueError):
        return Derating()


def load_capacity() -> Capacity:
    """This machine's capacity for `dilation: auto` (CalibrationError: a broken file)."""
    path = calibration_path()
    return capacity_from(read_calibration(path), path, machine_name(), machine_slowdown())


def save_budget(data: dict) -> Path:
    """Write a fresh calibration (`testbed calibrate`). A new capacity measurement
    supersedes this machine's derating (it corrected the old one); other machines' are
    kept, and so is this machine's when only the per-port budget was measured."""
    path = calibration_path()
    try:
        old = read_calibration(path)
    except CalibrationError:
        old = {}
    out = {"format": CALIBRATION_FORMAT, **data}
    others = {m: d for m, d in (old.get("derating") or {}).items()
              if m != machine_name() or "capacity" not in data}
    if others and "derating" not in data:
        out["derating"] = others
    _write(path, out)
    return path


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def record_run(summary: dict, dilation: dict) -> str | None:
    """Teach this machine's derating one run's outcome (the runner's summary and the
    plan's dilation, as JSON): only a run whose D the capacity rule allowed teaches it.
    Returns what changed, for the console (None: nothing to learn, or no file to keep it
    in and nothing went wrong)."""
    cap = dilation.get("capacity") or {}
    least = cap.get("least_factor") or max(cap.get("need_factor", 0),
                                           cap.get("port_factor", 0), cap.get("rate_factor", 0))
    if not cap or not cap.get("streams") or dilation.get("factor", 0) < least * (1 - 1e-9):
        return None       # a D below what the capacity allows: expected to fall behind
    notes = summary.get("fidelity") or []
    fell = [n for n in notes if FELL_BEHIND_MARK in n]
    path = calibration_path()
    try:
        data = read_calibration(path)
    except CalibrationError:
        return None
    if not data and not fell:
        return None
    machine = machine_name()
    before = derating_of(data, machine)
    after = learn(before, fell_behind=bool(fell))
    entry = {"scale": after.scale, "clean_runs": after.clean_runs, "runs": after.runs,
             "fell_behind_runs": after.fell_behind_runs, "updated_unix": time.time(),
             "last": (fell[0][:200] if fell else "clean")}
    data = {**data, "format": CALIBRATION_FORMAT}     # format 2: every part optional
    data.setdefault("derating", {})[machine] = entry
    try:
        _write(path, data)
    except OSError as exc:
        return f"could not keep the run's outcome in {path}: {exc}"
    if after.scale != before.scale:
        return (f"derating of this machine's capacity: {before.scale:g} -> {after.scale:g} "
                f"({'a port or sender fell behind' if fell else 'clean runs'}; {path})")
    return None


#: What a fidelity note says when the machine, not the fabric, fell short: the port
#: watchdog's notes (testbed/run/fidelity.py) and the UDP senders' (testbed/workloads/
#: udp.py) both end with it.
FELL_BEHIND_MARK = "did not keep up"
