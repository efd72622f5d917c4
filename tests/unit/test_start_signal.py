"""The common start given once every sender is armed (agents.runtime.start)."""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import pytest

from agents.runtime import start as start_mod
from agents.runtime.lifecycle import Lifecycle
from agents.runtime.start import (
    add_start_arguments,
    await_start,
    read_armed_file,
    read_start_file,
    write_start_file,
)


def _args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--start-at-mono-ns", type=int, default=0)
    add_start_arguments(p)
    (tmp_path / "start").mkdir(exist_ok=True)
    return p.parse_args(["--start-file", str(tmp_path / "start" / "t0.json"),
                         "--armed-file", str(tmp_path / "a.armed"), *extra])


def _life() -> Lifecycle:
    return Lifecycle(watch_parent=False)


def _publish_when_armed(tmp_path: Path, t0_of_now) -> threading.Thread:
    """The run's side: wait for the armed file, then write the start file."""
    def go() -> None:
        while read_armed_file(str(tmp_path / "a.armed")) is None:
            time.sleep(0.001)
        write_start_file(str(tmp_path / "start" / "t0.json"), t0_of_now(time.monotonic_ns()))
    t = threading.Thread(target=go)
    t.start()
    return t


@pytest.mark.parametrize("inotify", [True, False])
def test_arms_then_starts_at_t0_plus_its_offset(tmp_path: Path, monkeypatch,
                                                 inotify: bool) -> None:
    if not inotify:
        def refuse(_directory: str) -> None:
            raise OSError("no inotify")
        monkeypatch.setattr(start_mod, "_Inotify", refuse)
    args = _args(tmp_path, "--start-offset-ns", "30000000")
    t0 = {}

    def t0_of(now: int) -> int:
        t0["v"] = now + 20_000_000
        return t0["v"]
    t = _publish_when_armed(tmp_path, t0_of)
    started = await_start(args, _life())
    t.join()
    done = time.monotonic_ns()
    assert started == t0["v"] + 30_000_000 == args.start_at_mono_ns
    assert done >= started                      # it waited for its own start time
    armed = read_armed_file(str(tmp_path / "a.armed"))
    assert armed is not None
    assert armed["armed_mono_ns"] <= armed["go_seen_mono_ns"] < started
    assert armed["start_mono_ns"] == started


def test_a_stop_before_the_start_returns_without_starting(tmp_path: Path) -> None:
    args = _args(tmp_path)
    life = _life()
    threading.Timer(0.05, lambda: life.stop("signal")).start()
    t = time.monotonic()
    assert await_start(args, life) == 0
    assert time.monotonic() - t < 2
    armed = read_armed_file(str(tmp_path / "a.armed"))
    assert armed is not None and "go_seen_mono_ns" not in armed   # never saw a start


def test_without_a_start_file_the_fixed_start_time_is_kept(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--start-at-mono-ns", type=int, default=0)
    add_start_arguments(p)
    target = time.monotonic_ns() + 20_000_000
    args = p.parse_args(["--start-at-mono-ns", str(target)])
    assert await_start(args, _life()) == target
    assert time.monotonic_ns() >= target
    assert await_start(p.parse_args([]), _life()) == 0


def test_a_start_file_is_read_whole_or_not_at_all(tmp_path: Path) -> None:
    path = str(tmp_path / "t0.json")
    assert read_start_file(path) is None
    write_start_file(path, 123)
    assert read_start_file(path) == 123
    assert [p.name for p in tmp_path.iterdir()] == ["t0.json"]   # no temporary left
