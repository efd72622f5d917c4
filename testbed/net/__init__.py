"""Stage 4: the only code that talks to the kernel.

Applies a plan with pyroute2 (netlink), tears labs down, probes the kernel
and reads counters. Nothing outside this package imports pyroute2.
"""

from pyroute2 import config as _pyroute2_config

from agents.timebase import machine_slowdown
from testbed.net.builder import (
                                  BuildError,
                                  BuildReport,
                                  apply_plan,
                                  destroy_all,
                                  destroy_lab,
                                  load_lab_plan,
)
from testbed.net.state import LabState, list_states

# pyroute2 forks a child to open a socket inside a namespace and waits 2 s for it (10 s
# in all): a slow machine (a TCG guest, about 20x slower) needs that much longer.
_pyroute2_config.default_communicate_timeout = 2 * machine_slowdown()
_pyroute2_config.default_create_socket_timeout = 10 * machine_slowdown()

__all__ = ["BuildError", "BuildReport", "LabState", "apply_plan", "destroy_all", "destroy_lab",
           "list_states", "load_lab_plan"]
