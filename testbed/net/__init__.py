"""Stage 4: the only code that talks to the kernel.

Applies a plan with pyroute2 (netlink), tears labs down, probes the kernel
and reads counters. Nothing outside this package imports pyroute2.
"""

from testbed.net.builder import (
                                  BuildError,
                                  BuildReport,
                                  apply_plan,
                                  destroy_all,
                                  destroy_lab,
                                  load_lab_plan,
)
from testbed.net.state import LabState, list_states

__all__ = ["BuildError", "BuildReport", "LabState", "apply_plan", "destroy_all", "destroy_lab",
           "list_states", "load_lab_plan"]
