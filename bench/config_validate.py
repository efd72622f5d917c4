"""How long `testbed validate` takes on large configs: a table of size, lines and seconds.

Run as `python -m bench.config_validate [MB ...]` (default 0.5 1 2 5). It times
stage 1 (load and check); compiling the plan is a separate, route-bound cost. The config is an
explicit fabric of one switch per 100 hosts and one link per host, the shape that
grows fastest with users' pasted inventories. Validation must stay linear in the
file's size: the seconds-per-MB column should stay flat.
"""

from __future__ import annotations

import sys
import time

from testbed.config import ConfigError, load_config_text


def big_config(target_bytes: int) -> str:
    """An explicit fabric config of about `target_bytes`."""
    head = ["name: big", "dilation: 2000", "nodes:", "  - {name: core, role: switch}"]
    nodes: list[str] = []
    links: list[str] = []
    size = 200
    i = 0
    while size < target_bytes:
        sw = f"s{i // 100}"
        if i % 100 == 0:
            nodes.append(f"  - {{name: {sw}, role: switch}}")
            links.append(f"  - {{a: {sw}, b: core, port: 400GBASE-DR4, length: 100m}}")
        nodes.append(f"  - {{name: h{i}, role: host}}")
        links.append(f"  - {{a: h{i}, b: {sw}, port: 100GBASE-CR1, length: 2m}}")
        size += len(nodes[-1]) + len(links[-1]) + 2
        i += 1
    return "\n".join([*head, *nodes, "links:", *links, ""])


def main(argv: list[str]) -> int:
    sizes = [float(a) for a in argv] or [0.5, 1.0, 2.0, 5.0]
    print(f"{'MB':>5} {'lines':>8} {'load s':>8} {'s/MB':>6}")
    for mb in sizes:
        text = big_config(int(mb * 1e6))
        t0 = time.perf_counter()
        try:
            loaded = load_config_text(text, "big.yaml")
        except ConfigError as exc:
            print(f"{mb:5.1f} refused: {exc.lines()[0]}")
            continue
        t1 = time.perf_counter()
        assert loaded.fabric.name == "big"
        print(f"{len(text) / 1e6:5.2f} {text.count(chr(10)):8d} {t1 - t0:8.2f} "
              f"{(t1 - t0) / (len(text) / 1e6):6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
