"""Stage 3: the plan - a pure, deterministic compile of config + PHY + dilation."""

from testbed.plan.compile import (
    DEFAULT_MAX_WALL_PORT_RATE_BPS,
    NETNS_PREFIX,
    choose_dilation,
    compile_plan,
    netns_name,
)
from testbed.plan.model import PLAN_FORMAT_VERSION, Plan

__all__ = ["DEFAULT_MAX_WALL_PORT_RATE_BPS", "NETNS_PREFIX", "PLAN_FORMAT_VERSION", "Plan",
           "choose_dilation", "compile_plan", "netns_name"]
