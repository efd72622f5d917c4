"""The collector's agent reads: a live snapshot becomes samples; an agent that does not
answer in time is skipped and counted, and the run's fidelity notes say so."""

from __future__ import annotations

import socket
import threading

import pytest

from agents.runtime.control import SnapshotServer
from testbed.run.collector import AgentEndpoint, agent_read_notes, read_agent_samples


def test_a_snapshot_becomes_samples(tmp_path):
    path = str(tmp_path / "a.sock")
    server = SnapshotServer(path, lambda: {"mode": "send", "bytes": 42, "ok": True,
                                           "ports": [{"port": "eth0", "tclass": 3,
                                                      "pause_tx": 2}]})
    try:
        agent = AgentEndpoint(name="w-h1-h2", node="h1", sock_path=path)
        samples = read_agent_samples(agent)
    finally:
        server.close()
    got = {(s.node, s.port, s.tclass, s.counter): s.value for s in samples}
    assert got == {("h1", "w-h1-h2", -1, "send.bytes"): 42.0,
                   ("h1", "eth0", 3, "pause_tx"): 2.0}
    assert (agent.reads, agent.failed_reads) == (1, 0)
    assert agent_read_notes([agent]) == []


def test_an_agent_that_does_not_answer_is_counted_and_noted(tmp_path):
    path = str(tmp_path / "busy.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    held = []
    stop = threading.Event()

    def accept_and_say_nothing():
        listener.settimeout(0.05)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept_and_say_nothing, daemon=True)
    t.start()
    try:
        agent = AgentEndpoint(name="w-h3-h8", node="h3", sock_path=path)
        assert read_agent_samples(agent, timeout_s=0.05) == []
        assert read_agent_samples(agent, timeout_s=0.05) == []
    finally:
        stop.set()
        t.join()
        for conn in held:
            conn.close()
        listener.close()
    assert (agent.reads, agent.failed_reads) == (2, 2)
    quiet = AgentEndpoint(name="pfc-leaf1", node="leaf1", sock_path=path, reads=5)
    (note,) = agent_read_notes([quiet, agent])
    assert "1 agent(s)" in note and "w-h3-h8 2/2" in note and "pfc-leaf1" not in note


def test_garbage_counts_as_a_failed_read(tmp_path):
    path = str(tmp_path / "junk.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def answer_junk():
        conn, _ = listener.accept()
        with conn:
            conn.sendall(b"{not json\n")

    t = threading.Thread(target=answer_junk, daemon=True)
    t.start()
    try:
        agent = AgentEndpoint(name="x", node="h1", sock_path=path)
        assert read_agent_samples(agent, timeout_s=1.0) == []
    finally:
        t.join()
        listener.close()
    assert agent.failed_reads == 1


def test_an_agent_without_a_socket_is_not_asked(tmp_path):
    agent = AgentEndpoint(name="gone", node="h1", sock_path=str(tmp_path / "none.sock"))
    assert read_agent_samples(agent) == []
    assert (agent.reads, agent.failed_reads) == (0, 0)


@pytest.mark.parametrize("n", [6, 9])
def test_the_note_names_the_worst_five(n):
    agents = [AgentEndpoint(name=f"a{i}", node="h1", sock_path="", reads=10, failed_reads=i + 1)
              for i in range(n)]
    (note,) = agent_read_notes(agents)
    assert note.startswith(f"{n} agent(s)")
    assert f"a{n - 1} {n}/10" in note and f"and {n - 5} more" in note
    assert "a0 " not in note            # the least affected is left to "more"
