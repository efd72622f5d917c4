"""One RoCE server process serving several streams (`server --streams FILE`,
agents/roce/responder.py): each stream set up by its own client, with its own QPs,
verification and counters, all on one UDP socket; a stream that fails or never comes
does not hide the others' results. The real programs on 127.0.0.1 (no root), then the
streams file's checks and the live snapshot as the run's collector stores it."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest

from agents.roce import __main__ as roce_main
from agents.roce.perftest import Live
from agents.roce.responder import StreamsError, load_streams, stream_parser
from testbed.run import collector
from tests.conftest import REPO

TIMEOUT = ["--timeout-ns", "1000000000"]


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _streams_file(tmp_path: Path, streams: dict[str, tuple[str, str]], udp: int) -> Path:
    """name -> (test, client address): each stream takes set-up from its client only."""
    path = tmp_path / "streams.json"
    path.write_text(json.dumps({"streams": [
        {"name": name, "argv": [test, "--verify", "--peer-subnet", f"{ip}/32",
                                "--roce-port", str(udp), *TIMEOUT]}
        for name, (test, ip) in streams.items()]}))
    return path


def _start_server(tmp_path: Path, streams: Path) -> tuple[subprocess.Popen, int]:
    ready = tmp_path / "ready"
    server = subprocess.Popen(
        [sys.executable, "-m", "agents.roce", "server", "--streams", str(streams),
         "--bind", "127.0.0.1", "--port", "0", "--ready-file", str(ready),
         "--out", str(tmp_path / "server.json"), "--connect-timeout-s", "5"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not ready.exists():
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise AssertionError(f"server never became ready: {server.communicate()}")
        time.sleep(0.02)
    return server, json.loads(ready.read_text())["port"]


def _client(name: str, test: str, ip: str, port: int, iters: int, *extra: str
            ) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "agents.roce", "client", test, "--server", "127.0.0.1",
         "--port", str(port), "--bind", ip, "--stream", name, "--size", "16384",
         "--iters", str(iters), "--verify", *TIMEOUT, *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout_s: float = 120) -> tuple[int, dict, str]:
    out, err = proc.communicate(timeout=timeout_s)
    return proc.returncode, json.loads(out.strip().splitlines()[-1]), err


def test_three_streams_into_one_process_each_verified_and_counted_on_one_socket(tmp_path):
    udp = _free_udp_port()
    streams = {"a": ("write_bw", "127.0.0.2"), "b": ("send_bw", "127.0.0.3"),
               "c": ("write_bw", "127.0.0.4")}
    iters = {"a": 40, "b": 24, "c": 8}
    server, port = _start_server(tmp_path, _streams_file(tmp_path, streams, udp))
    try:
        clients = {n: _client(n, t, ip, port, iters[n]) for n, (t, ip) in streams.items()}
        done = {n: _finish(p) for n, p in clients.items()}
        rc, srv, err = _finish(server, 60)
    finally:
        for p in [server, *clients.values()]:
            if p.poll() is None:
                p.kill()
                p.wait()
    for n, (crc, c, cerr) in done.items():
        assert crc == 0 and c["verified"] is True and c["messages"] == iters[n], (n, cerr)
    assert rc == 0, err
    assert srv["stream_count"] == 3 and srv["error"] is None
    assert set(srv["streams"]) == {"a", "b", "c"}
    qpns = set()
    for n, st in srv["streams"].items():
        # each stream: its own client, its own QP, its own verdict and counts
        assert (st["client"], st["test"]) == (streams[n][1], streams[n][0])
        assert st["verified"] is True and st["stopped_by"] == "done", n
        assert st["messages"] == iters[n] == sum(
            q["responder"]["write_messages"] + q["responder"]["send_messages"]
            for q in st["qps"].values())
        assert st["udp_port"] == udp
        qpns |= set(st["qps"])
    assert len(qpns) == 3
    # one socket took every stream's datagrams, and counts what it dropped full
    (ep,) = srv["endpoints"]
    packets = sum(q["responder"]["packets_received"] for st in srv["streams"].values()
                  for q in st["qps"].values())
    assert ep["datagrams_received"] == packets and ep["local"] == f"127.0.0.1:{udp}"
    assert srv["rx_socket_drops"] == 0 and srv["setup_refused_total"] == 0


def test_a_stream_that_fails_or_never_comes_does_not_hide_the_others(tmp_path):
    udp = _free_udp_port()
    streams = {"good": ("write_bw", "127.0.0.2"), "gone": ("write_bw", "127.0.0.3"),
               "absent": ("write_bw", "127.0.0.4")}
    server, port = _start_server(tmp_path, _streams_file(tmp_path, streams, udp))
    try:
        # a client that is killed mid-run (a long test it never finishes)
        gone_ready = tmp_path / "gone.ready"
        gone = _client("gone", "write_bw", "127.0.0.3", port, 10**6,
                       "--ready-file", str(gone_ready))
        deadline = time.monotonic() + 30
        while not gone_ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)                   # it is sending
        good = _client("good", "write_bw", "127.0.0.2", port, 16)
        grc, g, gerr = _finish(good)
        gone.kill()
        gone.wait()
        # a client naming no stream of this server is refused; the server serves on
        stray = _client("nobody", "write_bw", "127.0.0.2", port, 4)
        src, _s, serr = _finish(stray)
        time.sleep(1.0)
        assert server.poll() is None      # still waiting for `absent`
        server.send_signal(signal.SIGTERM)
        rc, srv, err = _finish(server, 60)
    finally:
        for p in (server, good, gone, stray):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert grc == 0 and g["verified"] is True, gerr
    assert src != 0 and "none of this server's streams" in serr
    st = srv["streams"]
    assert st["good"]["verified"] is True and st["good"]["messages"] == 16
    assert st["gone"]["stopped_by"] == "client_gone" and st["gone"]["verified"] is None
    assert st["gone"]["qps"] and st["gone"]["messages"] < 10**6
    assert st["absent"]["stopped_by"] == "signal:SIGTERM" and st["absent"]["qps"] == {}
    assert srv["setup_refused"] == {"stream": 1}
    assert rc == 0, err


def _process(**kw) -> Namespace:
    args = roce_main.build_parser().parse_args(["server", "--streams", "x"])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def _write(tmp_path: Path, streams: list) -> str:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"streams": streams}))
    return str(path)


@pytest.mark.parametrize(("streams", "message"), [
    ([{"name": "a", "argv": ["write_bw"]}, {"name": "a", "argv": ["write_bw"]}],
     "streams[1].name: 'a' is also streams[0]'s"),
    ([{"name": "a", "argv": ["write_bw", "--dilation", "3"]}],
     "streams[0].argv: --dilation is the process's option"),
    ([{"name": "a", "argv": ["--verify"]}], "streams[0].argv: name the test first"),
    ([{"name": "a", "argv": ["write_bw"]}, {"name": "b", "argv": ["write_bw", "--dscp", "3"]}],
     "streams[1].argv: --dscp 3 differs from stream 'a' (26) on the same UDP port 4791"),
    ([{"argv": ["write_bw"]}], "streams[0].name: give each stream a non-empty name"),
    ([], 'needs {"streams": '),
])
def test_a_bad_streams_file_names_the_file_and_the_field(tmp_path, streams, message):
    path = _write(tmp_path, streams)
    with pytest.raises(StreamsError) as e:
        load_streams(path, stream_parser(roce_main.build_parser()), _process())
    assert str(e.value).startswith(path + ": ") and message in str(e.value), str(e.value)


def test_streams_take_the_process_options_and_other_dscps_another_port(tmp_path):
    path = _write(tmp_path, [
        {"name": "a", "argv": ["write_bw", "--window-packets", "77"]},
        {"name": "b", "argv": ["send_bw", "--dscp", "3", "--roce-port", "4792"]}])
    a, b = load_streams(path, stream_parser(roce_main.build_parser()),
                        _process(dilation=500, bind="10.0.0.1"))
    assert (a.name, a.args.test, a.args.window_packets, a.args.dilation, a.args.bind) == (
        "a", "write_bw", 77, 500, "10.0.0.1")
    assert (b.args.test, b.args.dscp, b.args.roce_port) == ("send_bw", 3, 4792)


def test_each_streams_live_counters_are_stored_under_its_own_name(tmp_path, monkeypatch):
    live = Live("server", None)
    live.streams = [("inc-h1-h8-srv", []), ("inc-h2-h8-srv", [])]
    live.stream_phase = lambda: {"inc-h1-h8-srv": "running", "inc-h2-h8-srv": "waiting"}
    snap = live.snapshot()
    assert snap["mode"] == "responder" and snap["streams_running"] == 1
    assert [s["name"] for s in snap["streams"]] == ["inc-h1-h8-srv", "inc-h2-h8-srv"]
    sock = tmp_path / "a.sock"
    sock.touch()
    monkeypatch.setattr(collector, "read_snapshot", lambda *_a, **_k: snap)
    agent = collector.AgentEndpoint("roce-responder-h8", "h8", str(sock))
    samples = collector.read_agent_samples(agent)
    keys = {(s.port, s.counter) for s in samples}
    # the report's per-agent receive rates read recv.bytes per (node, agent name)
    assert ("inc-h1-h8-srv", "recv.bytes") in keys and ("inc-h2-h8-srv", "recv.bytes") in keys
    assert ("roce-responder-h8", "responder.streams_running") in keys
    assert not any(p == "roce-responder-h8" and c.startswith("recv.") for p, c in keys)


def test_a_roce_client_process_holds_neither_the_servers_module_nor_difflib():
    # 128 hosts run 127 clients: every module one imports is paid 127 times
    # (bench/agent_memory.py); difflib (~0.35 MB) only names a mistyped cc parameter
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, agents.roce.__main__; print(sorted(m for m in "
         "sys.modules if m in ('difflib', 'agents.roce.responder')))"],
        cwd=REPO, capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "[]"


def test_the_responder_asks_for_the_cpu_weight_of_its_streams_servers():
    from agents.roce.responder import responder_nice
    # CFS: weight 1024 / 1.25^nice; one stream is one server's weight
    assert [responder_nice(n) for n in (1, 2, 3, 31, 127, 10_000)] == [0, -3, -5, -15, -20, -20]
    assert 1.25 ** -responder_nice(31) == pytest.approx(31, rel=0.15)


def test_a_last_line_longer_than_the_pipe_survives_a_sigterm_while_it_waits():
    # a responder done before the run reads its ~0.5 MB line blocks on the full pipe;
    # the run's SIGTERM then came in the middle of print(), which dropped the rest
    code = ("import signal\nsignal.signal(signal.SIGTERM, lambda *a: None)\n"
            "from agents.runtime.output import report_counters\n"
            "report_counters({'pad': 'x' * 500000})\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(1.5)               # blocked on the pipe by now
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert len(json.loads(out)["pad"]) == 500000
