"""The RoCE server side: one process serving every perftest-style stream into its host.

A perftest server serves exactly one client; a run that gave every stream a server
process of its own ran 127 of them on the receiving host of a 127:1 incast (bench/
agent_memory.py: ~17 MB of RSS each). Here one process serves any number of streams,
as an RNIC serves every QP of its host:

- `python -m agents.roce server TEST [options]` serves the one stream the command line
  describes (any client; its result is the flat JSON it always was);
- `python -m agents.roce server --streams FILE [process options]` serves every stream
  FILE lists: `{"streams": [{"name": NAME, "argv": [TEST, server options...]}, ...]}`,
  each stream's argv what `server` would take for it alone (its test, --verify,
  --peer-subnet, --roce-port, window, congestion control, DSCPs, ...) except the
  process's own options (PROCESS_OPTIONS), which only the command line gives. A client
  names its stream in its hello (`--stream NAME`).

Each stream has its own QPs, memory regions, verification and counters; one engine
steps them all in one loop (`Responder.run`): receive, timers, ACKs, and between
steps the set-up connections (accepted and read without blocking), the clients' "done"
messages, and the write_bw verification, 64 KiB per loop turn, so a stream being
checked never stops the others being served. A stream that fails (an error, a client
that went away, data that did not verify) ends alone; the others' results stand.

Streams with the same --roce-port share one UDP socket (an `agents.rdma.transport.
Endpoint`, which demultiplexes by destination QPN and checks each QP's peer), as all
QPs of a real RoCE host share UDP 4791. A socket has one TOS for its data and ACKs, so
streams that share a port must agree on --dscp / --cnp-dscp / --sndbuf-bytes (checked
when the file is read; `testbed run` gives streams of another class another port).
The socket counts the datagrams it dropped full (SO_RXQ_OVFL, `rx_socket_drops`): a
responder that falls behind says so.
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import random
import socket
import time
from argparse import Namespace
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from agents.rdma.options import cc_params, cc_record, cc_settings, make_np, make_rate_controller
from agents.rdma.options import qp_attrs as make_qp_attrs
from agents.rdma.qp import MemoryRegion, RcQp
from agents.rdma.transport import Binding, Endpoint, Engine, Stopped
from agents.roce.hello import check_hello
from agents.roce.perftest import (
    CONTROL_CHECK_STEPS,
    MAX_RECV_DEPTH,
    PROTOCOL_VERSION,
    ControlChannel,
    ControlRefused,
    Live,
    TestError,
    _fast_path,
    _listen,
    _Serving,
    _sum_malformed,
    _verify_writes_steps,
    address,
    pattern,
    peer_allowed,
    region,
)
from agents.runtime.lifecycle import Lifecycle
from agents.runtime.messages import BadMessage
from agents.runtime.output import mark_ready
from agents.timebase import Dilation, FabricClock
from agents.wire.roce import PSN_MASK, icrc_context

#: Options of the process, not of a stream: only the command line gives them.
PROCESS_OPTIONS = ("--bind", "--port", "--dilation", "--spin-ns", "--connect-timeout-s",
                   "--control-sock", "--ready-file", "--out", "--wall", "--streams")
#: Options that streams sharing a UDP port (one socket) must agree on.
SOCKET_OPTIONS = ("dscp", "cnp_dscp", "sndbuf_bytes")
#: Server QPNs start here (a client's QPs are numbered apart, from a random base).
FIRST_QPN = 0x200
#: Receive buffer a one-stream server's socket had; a shared socket gets it per stream.
STREAM_RCVBUF_BYTES = 4 << 20
MAX_RCVBUF_BYTES = 512 << 20
#: CFS gives a process weight 1024 / 1.25^nice: a nice step is a factor of 1.25.
CFS_NICE_STEP = 1.25


def responder_nice(streams: int) -> int:
    """The nice value that gives one process the CPU weight of `streams` processes of nice
    0 (-log_1.25(streams), at most -20): what the per-stream servers had between them
    on a loaded machine, where the kernel shares the CPU out per process."""
    if streams <= 1:
        return 0
    return max(-20, -round(math.log(streams) / math.log(CFS_NICE_STEP)))

WAITING, RUNNING, FINISHING, VERIFYING, DONE = ("waiting", "running", "finishing",
                                                "verifying", "done")


class StreamsError(ValueError):
    """A streams file that cannot be served; the message names the file and the field."""


@dataclass
class StreamSpec:
    """One stream a responder serves: its name (None: the command line's one stream,
    any client) and its server options."""

    name: str | None
    args: Namespace


def load_streams(path: str, parse: Callable[[list[str]], Namespace],
                 process: Namespace) -> list[StreamSpec]:
    """The streams of a --streams file, each stream's argv parsed by `parse` (the server's
    own parser, which exits 2 on bad options) and completed with the process's options."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise StreamsError(f"{path}: cannot read it: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise StreamsError(f"{path}: not JSON: {e}") from None
    items = data.get("streams") if isinstance(data, dict) else None
    if not isinstance(items, list) or not items:
        raise StreamsError(f'{path}: needs {{"streams": [{{"name": ..., "argv": [...]}}, '
                           '...]}} with at least one stream')
    out: list[StreamSpec] = []
    seen: dict[str, int] = {}
    by_port: dict[int, StreamSpec] = {}
    for i, item in enumerate(items):
        where = f"{path}: streams[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) \
                or not item["name"]:
            raise StreamsError(f"{where}.name: give each stream a non-empty name")
        name = item["name"]
        if name in seen:
            raise StreamsError(f"{where}.name: {name!r} is also streams[{seen[name]}]'s")
        seen[name] = i
        argv = item.get("argv")
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise StreamsError(f"{where}.argv: a list of strings (the stream's server "
                               "options, its test first)")
        own = [a for a in argv if a.split("=", 1)[0] in PROCESS_OPTIONS]
        if own:
            raise StreamsError(f"{where}.argv: {', '.join(own)} is the process's option; give "
                               "it on the command line, not per stream")
        try:
            args = parse(argv)
        except SystemExit:
            raise StreamsError(f"{where}.argv: not server options (argparse says why, "
                               "above)") from None
        if args.test is None:
            raise StreamsError(f"{where}.argv: name the test first (write_bw, send_bw, "
                               "write_lat)")
        for key in ("bind", "port", "dilation", "spin_ns", "connect_timeout_s", "wall"):
            setattr(args, key, getattr(process, key))
        if args.roce_port == 0:
            raise StreamsError(f"{where}.argv: --roce-port 0 (a free port) is for one "
                               "stream alone; give each port")
        spec = StreamSpec(name, args)
        first = by_port.setdefault(args.roce_port, spec)
        for key in SOCKET_OPTIONS:
            if getattr(first.args, key) != getattr(args, key):
                raise StreamsError(
                    f"{where}.argv: --{key.replace('_', '-')} {getattr(args, key)} differs "
                    f"from stream {first.name!r} ({getattr(first.args, key)}) on the same "
                    f"UDP port {args.roce_port}: one socket sends with one TOS; give this "
                    "stream another --roce-port")
        out.append(spec)
    return out


@dataclass
class _Pending:
    """A set-up connection whose hello has not come yet."""

    ctl: ControlChannel
    peer: str
    deadline: float            # time.monotonic() by which the hello must have come


@dataclass
class _Stream:
    """One stream's state in the responder: set-up, serving, verification, result."""

    spec: StreamSpec
    index: int
    state: str = WAITING
    ctl: ControlChannel | None = None
    bindings: list[Binding] = field(default_factory=list)
    mems: list[mmap.mmap] = field(default_factory=list)
    serving: _Serving | None = None
    endpoint: Endpoint | None = None
    info: dict = field(default_factory=dict)     # what set-up learnt (peer, size, ...)
    result: dict = field(default_factory=dict)   # _Serving.result, then the verdict
    done_msg: dict | None = None
    check: Iterator[None] | None = None          # the write_bw verification, by chunks
    started_ns: int = 0
    stopped_by: str | None = None
    error: str | None = None

    @property
    def name(self) -> str | None:
        return self.spec.name

    @property
    def args(self) -> Namespace:
        return self.spec.args


class Responder:
    """Serves `streams` from one listening socket and one engine until each is done (or a
    stop); `run` returns the counters and the exit code."""

    def __init__(self, args: Namespace, streams: list[StreamSpec], life: Lifecycle,
                 live: Live) -> None:
        self.args = args
        self.life = life
        self.live = live
        self.multi = streams[0].name is not None
        self.streams = [_Stream(s, i) for i, s in enumerate(streams)]
        self.by_name = {s.name: s for s in self.streams}
        self.dilation = Dilation(args.dilation)
        self.clock = FabricClock(self.dilation)
        self.engine = Engine(self.clock, self.dilation, spin_ns=args.spin_ns)
        self.endpoints: dict[int, Endpoint] = {}
        self.pending: list[_Pending] = []
        self.next_qpn = FIRST_QPN
        self.per_port = {p: sum(1 for s in streams if s.args.roce_port == p)
                         for p in {s.args.roce_port for s in streams}}
        self.nice = self._raise_priority(len(streams))
        # every stream's subnets: a connection from elsewhere is refused before its hello
        subnets = [n for s in streams for n in (s.args.peer_subnet or [None])]
        self.any_subnets = None if None in subnets else [str(n) for n in subnets]
        if self.multi:
            live.streams = [(s.name or "", s.bindings) for s in self.streams]
            live.stream_phase = lambda: {s.name or "": s.state for s in self.streams}
        else:       # the flat snapshot a one-stream server always served
            live.bindings = self.streams[0].bindings

    @staticmethod
    def _raise_priority(streams: int) -> dict:
        """Ask for the CPU share the streams' own servers had (responder_nice): on a
        machine loaded by other agents the kernel shares the CPU out per process, and
        one process serving 127 streams would get 1/127 of what they had, fall behind
        and drop in its socket. Needs CAP_SYS_NICE (a run's agents are root); without
        it the result says so."""
        want = responder_nice(streams)
        if want == 0:
            return {"asked": 0, "set": True}
        try:
            os.setpriority(os.PRIO_PROCESS, 0, want)
        except OSError as e:
            return {"asked": want, "set": False, "reason": e.strerror}
        return {"asked": want, "set": True}

    # -- the loop

    def run(self) -> tuple[dict, int]:
        # a free UDP port (--roce-port 0, one stream alone) is picked here, before ready
        lsock = _listen(self.args, backlog=max(8, len(self.streams)))
        ports = sorted({s.args.roce_port for s in self.streams})
        mark_ready(self.args.ready_file, {"port": lsock.getsockname()[1],
                                          "roce_port": ports[0], "roce_ports": ports,
                                          "pid": os.getpid()})
        lsock.setblocking(False)
        steps = 0
        try:
            while not self.life.should_stop() and any(s.state != DONE for s in self.streams):
                busy = self.engine.step()
                steps += 1
                for s in self.streams:
                    if s.state == RUNNING and s.serving is not None:
                        s.serving.step()
                    elif s.state == VERIFYING:
                        self._verify_chunk(s)
                        busy = True
                if not busy or steps % CONTROL_CHECK_STEPS == 0:
                    self._accept(lsock)
                    self._read_hellos()
                    for s in self.streams:
                        self._progress(s)
                if not busy and not self.life.should_stop():
                    self.engine.extra_fds = [lsock, *(p.ctl for p in self.pending),
                                             *(s.ctl for s in self.streams
                                               if s.state == RUNNING and s.ctl is not None)]
                    self.engine.wait()
        except Stopped:
            pass
        finally:
            lsock.close()
            for p in self.pending:
                p.ctl.close()
        try:
            for s in self.streams:
                self._wind_down(s)
        finally:
            for s in self.streams:
                if s.ctl is not None:
                    s.ctl.close()
            for ep in self.endpoints.values():
                ep.close()
        self.live.phase = "done"
        return self._counters()

    # -- set-up

    def _accept(self, lsock: socket.socket) -> None:
        """Take every waiting set-up connection (never blocks)."""
        while True:
            try:
                conn, addr = lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                continue           # the peer went before we took it (ECONNABORTED)
            conn.setblocking(True)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ctl = ControlChannel(conn)
            peer = addr[0]
            if not peer_allowed(peer, self.any_subnets):
                self._refuse(ctl, peer, BadMessage(
                    "peer", f"{peer} is outside --peer-subnet {', '.join(self.any_subnets or [])}"))
                continue
            self.pending.append(_Pending(ctl, peer,
                                         time.monotonic() + self.args.connect_timeout_s))

    def _read_hellos(self) -> None:
        """Each pending connection's hello, if it came: a stream set up, or a refusal."""
        now = time.monotonic()
        for p in list(self.pending):
            try:
                try:
                    hello = p.ctl.poll()
                except ControlRefused as e:
                    raise BadMessage(e.reason, str(e)) from None
                if hello is None:
                    if p.ctl.closed:
                        raise BadMessage("closed", "the peer closed the control connection")
                    if now > p.deadline:
                        raise BadMessage("silent", "no answer on the control connection "
                                         f"within {self.args.connect_timeout_s} s")
                    continue
                self.pending.remove(p)
                s = self._stream_for(hello, p.peer)
            except BadMessage as e:
                if p in self.pending:
                    self.pending.remove(p)
                self._refuse(p.ctl, p.peer, e)
                continue
            self._start(s, p.ctl, hello)

    def _stream_for(self, hello: dict, peer: str) -> _Stream:
        """The waiting stream a well-formed hello from `peer` sets up (BadMessage if none)."""
        if self.multi:
            name = hello.get("stream")
            s = self.by_name.get(name) if isinstance(name, str) else None
            if s is None:
                raise BadMessage("stream", f"hello.stream {str(name)[:60]!r} is none of this "
                                 "server's streams")
        else:
            s = self.streams[0]
        if s.state != WAITING:
            what = f"stream {s.name}" if s.name else "this server's stream"
            raise BadMessage("stream", f"{what} is already set up")
        if not peer_allowed(peer, s.args.peer_subnet):
            raise BadMessage("peer", f"{peer} is outside stream {s.name}'s --peer-subnet "
                             f"{', '.join(map(str, s.args.peer_subnet))}")
        check_hello(hello, s.args.test, PROTOCOL_VERSION)
        return s

    def _refuse(self, ctl: ControlChannel, peer: str, e: BadMessage) -> None:
        self.live.refuse(e.reason, str(e), peer)
        ctl.send({"ok": False, "error": str(e)})
        ctl.close()

    def _endpoint(self, local_ip: str, args: Namespace) -> Endpoint:
        """The socket of `args.roce_port` (bound at its first stream's set-up)."""
        ep = self.endpoints.get(args.roce_port)
        if ep is not None:
            if ep.local_ip != local_ip:
                raise TestError(f"UDP port {args.roce_port} is bound on {ep.local_ip}, but "
                                f"this client reached {local_ip} (give --bind)")
            return ep
        # a socket shared by n streams buffers what their n sockets did
        rcvbuf = min(MAX_RCVBUF_BYTES, STREAM_RCVBUF_BYTES * self.per_port.get(args.roce_port, 1))
        ep = Endpoint(local_ip, args.roce_port, dscp=args.dscp, cnp_dscp=args.cnp_dscp,
                      should_stop=self.life.should_stop, rcvbuf_bytes=rcvbuf,
                      sndbuf_bytes=args.sndbuf_bytes or None, count_overflow=True)
        self.endpoints[args.roce_port] = ep
        self.engine.add(ep)
        self.live.endpoints = list(self.endpoints.values())
        return ep

    def _start(self, s: _Stream, ctl: ControlChannel, hello: dict) -> None:
        """Set the stream's QPs up from its client's hello and answer it; a failure
        ends this stream alone (its client is told why)."""
        s.ctl = ctl
        try:
            self._set_up(s, ctl, hello)
        except (TestError, OSError, ValueError) as e:
            s.error = str(e) if not isinstance(e, OSError) else f"{e.strerror or e}"
            s.stopped_by = "error"
            s.state = DONE
            ctl.send({"ok": False, "error": s.error})
            return
        s.state = RUNNING
        s.started_ns = time.monotonic_ns()
        if self.live.phase == "setup":
            self.live.phase = "running"

    def _set_up(self, s: _Stream, ctl: ControlChannel, hello: dict) -> None:
        args = s.args
        conn = ctl.sock
        local_ip = self.args.bind or conn.getsockname()[0]
        peer_ip = conn.getpeername()[0]
        ep = self._endpoint(local_ip, args)
        s.endpoint = ep
        cc = cc_settings(args)
        params = cc_params(args, cc)
        size, slots, seed = int(hello["size"]), int(hello["slots"]), int(hello["seed"])
        mtu = int(hello["mtu"])
        test = args.test
        verify = bool(hello.get("verify")) or args.verify
        attrs = make_qp_attrs(args, mtu)
        rng = random.Random()
        clock = self.clock
        rq_bufs: list[list[memoryview]] = []
        reply = []
        for c in hello["qps"]:
            qpn = self.next_qpn
            self.next_qpn += 1
            psn = rng.randrange(0, PSN_MASK + 1)
            rkey = rng.randrange(1, 1 << 32)
            mem = region(slots * size if test != "send_bw" else 1)
            s.mems.append(mem)
            mr = MemoryRegion(memoryview(mem), address(mem), rkey)
            ctx = icrc_context(local_ip, peer_ip, ep.port, int(c["sport"]))
            qp = RcQp(qpn, int(c["qpn"]), ctx, attrs,
                      make_rate_controller(args, cc, clock.now_ns()),
                      np=make_np(args, cc[0], params), mrs={rkey: mr}, clock=clock,
                      sq_psn=psn, rq_psn=int(c["psn"]))
            s.bindings.append(ep.attach(qp, (peer_ip, int(c["sport"]))))
            if test == "send_bw":
                depth = max(1, min(MAX_RECV_DEPTH, args.buffer_bytes // max(size, 1)))
                one = max(size, 1)
                ring = memoryview(region(depth * one))
                rbufs = [ring[k * one:(k + 1) * one] for k in range(depth)]
                for k, rb in enumerate(rbufs):
                    qp.responder.post_recv(k, rb)
                rq_bufs.append(rbufs)
            reply.append({"qpn": qpn, "psn": psn, "rkey": rkey, "va": mr.va,
                          "length": mr.length})
        self.engine.refresh()
        # send_bw checks each SEND as it lands, so it needs the patterns now; write_bw
        # checks its regions once the client is done, drawing the pattern a chunk at a
        # time then (_verify_writes_steps): no copy of every slot held through the run.
        expected = ([pattern(seed + i, slots * size) for i in range(len(s.bindings))]
                    if verify and test == "send_bw" else None)
        s.info = {"client": peer_ip, "local_ip": local_ip, "size": size, "slots": slots,
                  "mtu": mtu, "seed": seed, "verify": verify, "cc": cc, "params": params,
                  "attrs": attrs}
        s.serving = _Serving(test, s.bindings, hello["qps"], rq_bufs, slots, size, seed,
                             verify, expected)
        ctl.send({"ok": True, "qps": reply, "udp_port": ep.port})

    # -- a stream's end

    def _progress(self, s: _Stream) -> None:
        """Move a stream on: its client said done (or went), its last ACKs went out."""
        if s.state == RUNNING:
            assert s.ctl is not None
            try:
                msg = s.ctl.poll()
            except ControlRefused as e:
                msg, s.error = None, str(e)
                s.ctl.closed = True
            if msg is not None and msg.get("done"):
                s.done_msg = msg
                s.state = FINISHING
            elif s.ctl.closed:
                s.stopped_by = "client_gone"
                self._take_result(s)
                s.state = DONE
                return
        if s.state == FINISHING and all(b.qp.requester.idle for b in s.bindings):
            self._take_result(s)
            self._start_verdict(s)

    def _take_result(self, s: _Stream) -> None:
        if s.serving is not None:
            s.result = s.serving.result(self.dilation, time.monotonic_ns() - s.started_ns)
            s.result.pop("done_msg", None)

    def _start_verdict(self, s: _Stream) -> None:
        """write_bw / write_lat: check the regions (chunk by chunk, VERIFYING); send_bw
        checked as it went: answer now."""
        info, msgs = s.info, (s.done_msg or {}).get("messages", [])
        if info.get("verify") and s.args.test in ("write_bw", "write_lat"):
            if s.args.test == "write_lat":
                msgs, slots = [min(1, int(m)) for m in msgs], 1
            else:
                slots = info["slots"]
            s.check = _verify_writes_steps(s.mems, msgs, slots, info["size"], info["seed"],
                                           s.result)
            s.state = VERIFYING
            return
        self._answer(s)

    def _verify_chunk(self, s: _Stream) -> None:
        assert s.check is not None
        try:
            next(s.check)
        except StopIteration:
            s.check = None
            self._answer(s)

    def _answer(self, s: _Stream) -> None:
        if s.ctl is not None:
            s.ctl.send({"verified": s.result.get("verified"),
                        "first_mismatch": s.result.get("first_mismatch")})
        s.state = DONE

    def _wind_down(self, s: _Stream) -> None:
        """After the loop (all done, or a stop): a stream still going keeps what it has;
        one whose client already said done still gets its verdict."""
        if s.state == DONE:
            return
        s.stopped_by = s.stopped_by or self.life.stop_reason or "stopped"
        if s.state == WAITING:
            return
        if s.state in (RUNNING, FINISHING) and s.done_msg is None:
            self._take_result(s)
            s.state = DONE
            return
        if s.state == FINISHING:
            self._take_result(s)
            self._start_verdict(s)
        while s.state == VERIFYING:
            self._verify_chunk(s)

    # -- results

    def _stream_counters(self, s: _Stream) -> dict:
        """One stream's result: what a one-stream server reported, per stream."""
        args = s.args
        if not s.info:
            return {"role": "server", "test": args.test, "stopped_by": s.stopped_by,
                    "verified": None, "qps": {}, "error": s.error,
                    "fast_path": _fast_path(list(self.endpoints.values()))}
        info = s.info
        result = dict(s.result)
        error = s.error or next((b.qp.requester.error or b.qp.responder.error
                                 for b in s.bindings
                                 if b.qp.requester.error or b.qp.responder.error), None)
        return {
            "role": "server", "test": args.test, "client": info["client"],
            "local_ip": info["local_ip"], "size": info["size"], "slots": info["slots"],
            "mtu": info["mtu"], "dilation": self.dilation.factor,
            **cc_record(args, info["cc"], info["params"]),
            "line_rate_bps": args.line_rate_bps, "dscp": args.dscp, "cnp_dscp": args.cnp_dscp,
            "verified": result.pop("verified", None),
            "first_mismatch": result.pop("first_mismatch", None), **result,
            "qps": {str(b.qp.qpn): b.counters() for b in s.bindings},
            "udp_port": s.endpoint.port if s.endpoint is not None else args.roce_port,
            "fast_path": _fast_path([s.endpoint] if s.endpoint is not None else []),
            "qp_attrs": info["attrs"].to_dict(), "window_packets": info["attrs"].window_packets,
            "stopped_by": s.stopped_by or "done", "error": error,
        }

    def _counters(self) -> tuple[dict, int]:
        eps = list(self.endpoints.values())
        shared = {
            "malformed": _sum_malformed(eps), "endpoints": [ep.counters() for ep in eps],
            "rx_socket_drops": sum(ep.overflow_drops for ep in eps),
            "engine": {"steps": self.engine.steps, "waits": self.engine.waits},
            "nice": self.nice, **self.live.refusals()}
        per = {s.name: self._stream_counters(s) for s in self.streams}
        bad = [c for c in per.values() if c.get("verified") is False or c.get("error")]
        rc = 1 if bad else 0
        if not self.multi:
            return {**per[None], **shared}, rc
        return {"role": "server", "streams": per, "stream_count": len(per),
                "fast_path": _fast_path(eps), "stopped_by": self.life.stop_reason or "done",
                "error": next((c["error"] for c in per.values() if c.get("error")), None),
                **shared}, rc


def run_server(args: Namespace, life: Lifecycle, live: Live,
               streams: list[StreamSpec] | None = None) -> tuple[dict, int]:
    """Serve `streams` (a --streams file's, `load_streams`), or the command line's one."""
    return Responder(args, streams or [StreamSpec(None, args)], life, live).run()


def stream_parser(parser: argparse.ArgumentParser) -> Callable[[list[str]], Namespace]:
    """A stream's argv (its server options, test first) parsed as `server` would."""
    return lambda argv: parser.parse_args(["server", *argv])


__all__ = ["PROCESS_OPTIONS", "Responder", "StreamSpec", "StreamsError", "load_streams",
           "run_server", "stream_parser"]
