"""Control plane of the AI-fabric emulation testbed.

Pipeline: config -> phy -> plan -> net -> run -> report. Every stage but `net`
(and later `run`) is a pure function of the previous stage's output.
"""

__version__ = "0.1.0"
