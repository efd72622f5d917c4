"""Stage 5: the lifecycle of work on a built fabric - agents, traffic, checks."""
