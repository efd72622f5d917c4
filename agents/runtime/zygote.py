"""The zygote: one process per run that imports the agents' modules once, then forks
every agent of the run from itself instead of starting a new interpreter for each
(testbed/run/zygote.py is the runner's side; docs/run-format.md, "Agent start-up").

    python -m agents.runtime.zygote --sock-fd N --parent-pid P [MODULE ...]

An interpreter and an agent's imports cost ~70-85 ms of CPU per agent; a fork of a
process that holds them already costs ~1-3 ms. The zygote imports what each MODULE's
`__main__` imports (read with `ast`, so nothing of `__main__` runs here), and a module
asked for later when first asked. It then serves requests on the SOCK_SEQPACKET socket
of fd N, one JSON message each:

- runner -> zygote `{"op": "spawn", "id", "module", "argv", "netns", "keep_mounts"}`
  with three fds (the child's stdin, stdout, stderr) as SCM_RIGHTS;
  zygote -> runner `{"op": "spawned", "id", "pid", "start_time"}` or
  `{"op": "error", "id", "error"}`;
- zygote -> runner `{"op": "exit", "pid", "returncode"}` whenever it reaps a child
  (returncode as subprocess has it: negative for a signal);
- zygote -> runner `{"op": "ready", "pid", "modules", "failed"}` once, after the imports.

The child does what the exec path (`nsenter --net` / `ip netns exec`) did before the
agent's code runs: setns(2) into /var/run/netns/NETNS, and unless `keep_mounts`, what
`ip netns exec` adds: a private mount namespace (mounts propagate in only) with a /sys
of the namespace and /etc/netns/NETNS/* bound over /etc. No agent reads /sys/class/net
or /etc itself, but the perftest agent's tools read the rxe devices' sysfs, so the
remount is kept: a few syscalls, not a process. It then runs MODULE as `__main__`
(runpy, sys.argv = [its file, *argv]) and exits with its code, as `python -m` would.

Lifetime: the zygote dies with the runner (PR_SET_PDEATHSIG, SIGKILL: it has no state
of its own to save), and each child is given PR_SET_PDEATHSIG SIGTERM toward the
zygote, then checks the zygote is still its parent: an agent whose control plane is
gone stops (agents.runtime.lifecycle also sees its parent change; the signal closes the
gap before the agent has made its Lifecycle). PDEATHSIG follows the parent *thread*:
the runner starts the zygote from the thread that runs the run, and the zygote has no
threads at all before a fork (it refuses to fork if it has). What a fork would share
by accident is reset in the child: SIGINT/SIGCHLD handlers, the wakeup fd, the
zygote's socket, and the `random` module's seed. The hash seed of str is shared by all
children of one zygote (each `python -m` drew its own): no agent depends on set order.
The objects imported here are moved out of the collector's reach (gc.freeze) so
children do not copy the pages they share just by collecting them.
"""

from __future__ import annotations

import argparse
import array
import ast
import atexit
import ctypes
import gc
import importlib
import importlib.util
import json
import os
import random
import runpy
import select
import signal
import socket
import sys
import traceback
from types import FrameType

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 1 << 20
STDIO_FDS = 3

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_BIND = 4096
MS_REC = 16384
MS_SLAVE = 1 << 19
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
NETNS_RUN_DIR = "/var/run/netns"
NETNS_ETC_DIR = "/etc/netns"

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def set_parent_death_signal(sig: int) -> None:
    """prctl(PR_SET_PDEATHSIG): `sig` when the thread that forked us exits."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")


def enter_netns(netns: str) -> None:
    """setns(2) into the named namespace (/var/run/netns/NETNS), as `nsenter --net` does."""
    path = netns if netns.startswith("/") else f"{NETNS_RUN_DIR}/{netns}"
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(_libc.setns(fd, CLONE_NEWNET), f"setns({path})")
    finally:
        os.close(fd)


def remount_like_ip_netns_exec(netns: str) -> None:
    """What `ip netns exec` does after setns (iproute2 netns_switch): a mount namespace
    of our own that takes no mount back to the parent, /sys mounted afresh (it then
    describes this network namespace), and /etc/netns/NETNS/* bound over /etc/*."""
    name = os.path.basename(netns)
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(_libc.mount(b"", b"/", b"none", MS_SLAVE | MS_REC, None), "mount --make-rslave /")
    flags = 0
    if _libc.umount2(b"/sys", MNT_DETACH) != 0:
        # not mounted, or busy: mount over it, read-only if what is there is
        try:
            if os.statvfs("/sys").f_flag & os.ST_RDONLY:
                flags = MS_RDONLY
        except OSError:
            pass
    _check(_libc.mount(name.encode(), b"/sys", b"sysfs", flags, None), "mount /sys")
    etc = os.path.join(NETNS_ETC_DIR, name)
    try:
        entries = os.listdir(etc)
    except OSError:
        return
    for entry in entries:
        src, dst = os.path.join(etc, entry), os.path.join("/etc", entry)
        # as ip does: a failed bind is said, the command runs all the same
        if _libc.mount(src.encode(), dst.encode(), b"none", MS_BIND, None) != 0:
            err = ctypes.get_errno()
            print(f"Bind {src} -> {dst} failed: {os.strerror(err)}", file=sys.stderr)


def main_imports(module: str) -> list[str]:
    """The modules `python -m MODULE` imports at its top level (MODULE.__main__ for a
    package), read with ast: running __main__ here could start the agent."""
    spec = importlib.util.find_spec(module)
    if spec is None:
        raise ModuleNotFoundError(f"No module named {module!r}")
    out = []
    if spec.submodule_search_locations is not None:
        package = module
        out.append(module)       # a package's __init__ runs under `python -m` too
        spec = importlib.util.find_spec(f"{module}.__main__")
        if spec is None:
            raise ModuleNotFoundError(f"No module named {module}.__main__")
    else:
        # a plain module is itself the __main__: importing it would run it here
        package = module.rpartition(".")[0]
        parent = package
        while parent:
            out.insert(0, parent)
            parent = parent.rpartition(".")[0]
    if spec.origin is None or not spec.origin.endswith(".py"):
        return out
    with open(spec.origin, "rb") as fh:
        tree = ast.parse(fh.read(), filename=spec.origin)
    for node in tree.body:
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            out.append(base)
            # `from pkg import sub` may name a submodule: imported if it is one
            out += [f"{base}.{a.name}" for a in node.names]
    return out


def preload(modules: list[str]) -> tuple[list[str], dict[str, str]]:
    """Import what each module's `__main__` imports; (modules done, {module: why not})."""
    done: list[str] = []
    failed: dict[str, str] = {}
    for module in modules:
        try:
            for name in main_imports(module):
                if name == "__future__" or name in sys.modules:
                    continue
                try:
                    importlib.import_module(name)
                except ModuleNotFoundError as exc:
                    # `from pkg import name` where name is not a module: expected
                    if exc.name != name:
                        raise
            done.append(module)
        except (Exception, SystemExit) as exc:   # the child meets it again, says it
            failed[module] = f"{type(exc).__name__}: {exc}"
    return done, failed


def _exit_code(code: object) -> int:
    """sys.exit(code) as the interpreter turns it into a process exit code."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except Exception:
        pass
    return 1


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass


class Zygote:
    """The server: single-threaded, select() on the runner's socket and a wakeup pipe
    that SIGCHLD writes to."""

    def __init__(self, sock: socket.socket, parent_pid: int) -> None:
        self.sock = sock
        self.parent_pid = parent_pid
        self.children: set[int] = set()
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.imported: set[str] = set()

    def send(self, msg: dict) -> None:
        try:
            self.sock.send(json.dumps(msg).encode())
        except OSError:
            pass        # the runner is gone: PR_SET_PDEATHSIG ends us at once

    def serve(self) -> int:
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, _on_sigchld)
        while True:
            readable, _, _ = select.select([self.sock.fileno(), self.wake_r], [], [])
            if self.wake_r in readable:
                try:
                    while os.read(self.wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            self.reap()
            if self.sock.fileno() in readable:
                try:
                    msg, fds = recv_message(self.sock)
                except (ConnectionError, ValueError):
                    return 0
                if msg is None:
                    return 0       # the runner closed: the run is over
                self.handle(msg, fds)

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self.send({"op": "exit", "pid": pid,
                       "returncode": os.waitstatus_to_exitcode(status)})

    def handle(self, msg: dict, fds: list[int]) -> None:
        try:
            if msg.get("op") != "spawn":
                raise ValueError(f"unknown request {msg.get('op')!r}")
            if len(fds) != STDIO_FDS:
                raise ValueError(f"a spawn needs {STDIO_FDS} fds (stdin, stdout, stderr), "
                                 f"got {len(fds)}")
            pid = self.spawn(msg, fds)
            start = self.start_time(pid)
        except Exception as exc:
            self.send({"op": "error", "id": msg.get("id"), "error": f"{exc}"})
        else:
            self.send({"op": "spawned", "id": msg.get("id"), "pid": pid, "start_time": start})
        finally:
            for fd in fds:
                os.close(fd)

    def spawn(self, msg: dict, fds: list[int]) -> int:
        module = str(msg["module"])
        if module not in self.imported:
            # asked for a kind not given at start: import it once, here, for the next
            done, _failed = preload([module])
            self.imported.update(done)
        threads = sys.modules.get("threading")
        if threads is not None and threads.active_count() > 1:
            raise RuntimeError("the zygote has threads (an import started one): it does not "
                               "fork with threads")
        _flush_stdio()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = self.child(msg, fds)
            except SystemExit as exc:
                code = _exit_code(exc.code)
            except BaseException:
                try:
                    traceback.print_exc()
                except Exception:
                    pass
            _flush_stdio()
            os._exit(code)
        self.children.add(pid)
        return pid

    def start_time(self, pid: int) -> str | None:
        """Field 22 of /proc/PID/stat of a child not yet reaped (so surely ours): the
        runner records it with the pid and checks it before signalling by pid."""
        try:
            with open(f"/proc/{pid}/stat") as fh:
                return fh.read().rsplit(")", 1)[1].split()[19]
        except (OSError, IndexError):
            return None

    def child(self, msg: dict, fds: list[int]) -> int:
        """In the forked child: become the agent; returns its exit code."""
        zygote = os.getppid()
        self.sock.close()
        signal.set_wakeup_fd(-1)
        os.close(self.wake_r)
        os.close(self.wake_w)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)     # dup2 leaves the copy inheritable, as exec would
        for fd in fds:
            if fd > 2:
                os.close(fd)
        set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != zygote:
            return 1            # the zygote died before we got here: nobody waits for us
        netns = str(msg.get("netns") or "")
        if netns:       # "" stays where the zygote is (tests; nothing of a lab uses it)
            enter_netns(netns)
            if not msg.get("keep_mounts"):
                remount_like_ip_netns_exec(netns)
        # its /proc/PID/cmdline stays the zygote's: its name (ps -o comm, top, the
        # memory bench) says which agent it is, e.g. "pfc", "roce client"
        args = [str(a) for a in msg["argv"]]
        mode = args[0] if args and not args[0].startswith("-") else ""
        title = f"{str(msg['module']).removeprefix('agents.')} {mode}".strip()
        _libc.prctl(PR_SET_NAME, title.encode()[:15], 0, 0, 0)
        random.seed()
        module = str(msg["module"])
        sys.argv = [module, *[str(a) for a in msg["argv"]]]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc.code)
        except KeyboardInterrupt:
            traceback.print_exc()
            _flush_stdio()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
            code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        # what the interpreter's own exit would do: wait for non-daemon threads, atexit
        threads = sys.modules.get("threading")
        shutdown = getattr(threads, "_shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:
                pass
        try:
            atexit._run_exitfuncs()
        except Exception:
            pass
        return code


def _on_sigchld(_signum: int, _frame: FrameType | None) -> None:
    """Nothing: the wakeup fd wakes the loop, which reaps."""


def recv_message(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """One message and the fds that came with it; (None, []) at EOF."""
    fds = array.array("i")
    data, ancdata, flags, _addr = sock.recvmsg(MAX_MESSAGE_BYTES,
                                               socket.CMSG_SPACE(STDIO_FDS * fds.itemsize))
    for level, kind, cdata in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(cdata[:len(cdata) - (len(cdata) % fds.itemsize)])
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            os.close(fd)
        raise ValueError("message truncated")
    if not data:
        return None, list(fds)
    return json.loads(data), list(fds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agents.runtime.zygote",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--sock-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--lab", default="", help="the lab it serves (for `testbed down`)")
    parser.add_argument("modules", nargs="*")
    args = parser.parse_args(argv)
    sock = socket.socket(fileno=args.sock_fd)
    os.set_inheritable(args.sock_fd, False)
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != args.parent_pid:
        return 1                # the runner died while we started
    # Ctrl-C at a terminal reaches the whole process group: the runner decides what
    # stops, and stops the agents itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    server = Zygote(sock, args.parent_pid)
    done, failed = preload(args.modules)
    server.imported.update(done)
    gc.collect()
    gc.freeze()
    server.send({"op": "ready", "version": PROTOCOL_VERSION, "pid": os.getpid(),
                 "modules": done, "failed": failed})
    return server.serve()


if __name__ == "__main__":
    sys.exit(main())
