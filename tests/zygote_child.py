"""A stand-in agent for the zygote's tests (`python -m tests.zygote_child MODE ...`).

- `echo CODE ARG...`: prints {"argv", "pid", "ppid", "rand"} as a JSON line, a line to
  stderr, and exits with CODE;
- `wait`: an agent's stop loop (agents.runtime.lifecycle): prints "ready", then on
  SIGTERM or its parent's death prints {"stopped": reason} and exits 0;
- `netns`: prints {"ifaces": names from if_nameindex, "sys": /sys/class/net entries};
- `big N`: prints N bytes of "x" to stdout (more than a pipe holds).
"""

from __future__ import annotations

import json
import os
import random
import socket
import sys
import time

from agents.runtime.lifecycle import Lifecycle


def main() -> int:
    mode = sys.argv[1]
    if mode == "echo":
        print(json.dumps({"argv": sys.argv, "pid": os.getpid(), "ppid": os.getppid(),
                          "rand": random.random()}))
        print("to stderr", file=sys.stderr)
        return int(sys.argv[2])
    if mode == "wait":
        life = Lifecycle()
        life.install_signal_handlers()
        print("ready", flush=True)
        while not life.should_stop():
            time.sleep(0.01)
        print(json.dumps({"stopped": life.stop_reason}), flush=True)
        return 0
    if mode == "netns":
        print(json.dumps({"ifaces": sorted(n for _, n in socket.if_nameindex()),
                          "sys": sorted(os.listdir("/sys/class/net")),
                          "bpffs": os.path.ismount("/sys/fs/bpf")}))
        return 0
    if mode == "big":
        sys.stdout.write("x" * int(sys.argv[2]))
        return 0
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main())
