"""Where `testbed calibrate` keeps this machine's wall-rate budget for `dilation: auto`."""

from __future__ import annotations

import json
import os
from pathlib import Path

from agents.timebase import machine_slowdown
from testbed.plan import DEFAULT_MAX_WALL_PORT_RATE_BPS


def calibration_path() -> Path:
    return Path(os.environ.get("TESTBED_CALIBRATION", "/var/lib/testbed/calibration.json"))


def load_budget_bps() -> tuple[int, str]:
    """(budget, where it came from): the calibrated figure, or the conservative default."""
    path = calibration_path()
    try:
        data = json.loads(path.read_text())
        return int(data["max_wall_port_rate_bps"]), f"calibrated ({path})"
    except (OSError, ValueError, KeyError):
        pass
    slowdown = machine_slowdown()
    if slowdown > 1:
        # A slow machine (a TCG guest) carries far less: scale the default down with it.
        return (int(DEFAULT_MAX_WALL_PORT_RATE_BPS / slowdown),
                f"default for a machine {slowdown:g}x slower (run `testbed calibrate"
                f"{' --vm' if os.environ.get('TESTBED_VM') == '1' else ''}` to measure)")
    return DEFAULT_MAX_WALL_PORT_RATE_BPS, "default (run `testbed calibrate` to measure)"


def save_budget(data: dict) -> Path:
    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path
