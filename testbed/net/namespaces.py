"""Named network namespaces: create, remove, list, and run code inside one.

Only namespaces whose names start with the testbed prefix are ever created
or removed here. Nothing here forks: a namespace is made the way `ip netns add`
makes it (an empty file in /run/netns, unshare(CLONE_NEWNET), bind-mount the
new namespace on the file), but by a worker thread, which also writes the
namespace's sysctls and can open sockets while it is inside, then returns to
the namespace it came from. Code that must run inside a namespace uses
`inside(name)`. Either way only the calling thread moves, and a thread that
cannot move back ends the process (os._exit) rather than carry on in the wrong
namespace: the initial namespace is never modified. Two helpers run their work in
a thread of its own that ends with it: `in_scratch_namespace(fn)` (an unnamed
namespace, to see what a non-initial namespace offers) and `with_sysfs(names, fn)`
(a private mount namespace with each namespace's sysfs on /sys in turn).

(pyroute2's netns.create and IPRoute(netns=...) fork a child each: ~10 ms a
namespace for the two, and a forked copy inherits the parent's Python signal
handlers while pyroute2 stops it with SIGTERM. Threads are not forks: the worker
shares everything with the builder except, for a moment, its network namespace.)
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TypeVar

NETNS_RUN_DIR = "/var/run/netns"
PREFIX = "tb-"

# <sched.h>, <sys/mount.h>
CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_SLAVE = 0x80000
MS_SHARED = 0x100000
MNT_DETACH = 2
# Exit status of a process whose thread could not return to its namespace.
EXIT_STRANDED = 70

_libc = ctypes.CDLL(None, use_errno=True)
T = TypeVar("T")


class NamespaceError(RuntimeError):
    """Making a namespace failed: which one, at which step, and the system's reason."""

    def __init__(self, name: str, step: str, cause: BaseException) -> None:
        self.name, self.step, self.cause = name, step, cause
        super().__init__(f"namespace {name}: {step}: {cause}")


def _check(name: str) -> None:
    if not name.startswith(PREFIX):
        raise ValueError(f"refusing to touch namespace {name!r}: not a testbed namespace")


def _path(name: str) -> str:
    return os.path.join(NETNS_RUN_DIR, name)


def _sysctl_path(key: str) -> str:
    # Only net.* is per namespace; anything else would change the whole machine.
    if not key.startswith("net."):
        raise ValueError(f"sysctl {key!r} is not per network namespace; refusing to set it")
    return "/proc/sys/" + key.replace(".", "/")


def _libc_error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def list_testbed_namespaces() -> list[str]:
    try:
        names = os.listdir(NETNS_RUN_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(PREFIX))


def exists(name: str) -> bool:
    return os.path.exists(_path(name))


def inode(name: str) -> int | None:
    try:
        return os.stat(_path(name)).st_ino
    except FileNotFoundError:
        return None


def pid_netns_inode(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


# ---------------------------------------------------------------- switching

def _own_namespace() -> int:
    """An fd of the calling thread's network namespace (not the process's: /proc/self
    is the main thread)."""
    return os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)


def _return_to(home_fd: int) -> None:
    if _libc.setns(home_fd, CLONE_NEWNET) != 0:
        # This thread is in a lab namespace and cannot leave it. Whatever it did next
        # (a sysctl, a socket, a route) would land in the wrong place: stop everything.
        err = ctypes.get_errno()
        os.write(2, f"testbed: a thread could not return to its network namespace "
                    f"({os.strerror(err)}); exiting\n".encode())
        os._exit(EXIT_STRANDED)


@contextlib.contextmanager
def _coming_back() -> Iterator[None]:
    """Whatever network namespace the block moves this thread to, it comes back."""
    home = _own_namespace()
    try:
        try:
            yield
        finally:
            _return_to(home)
    finally:
        os.close(home)


def _enter(name: str) -> None:
    """Move this thread into the named namespace (inside _coming_back)."""
    target = os.open(_path(name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(target, CLONE_NEWNET) != 0:
            raise _libc_error(f"setns into {name}")
    finally:
        os.close(target)


@contextlib.contextmanager
def inside(name: str) -> Iterator[None]:
    """Run the block with this thread in namespace `name` (which must exist)."""
    _check(name)
    with _coming_back():
        _enter(name)
        yield


@contextlib.contextmanager
def inside_any(name: str) -> Iterator[None]:
    """Like inside(), for a named namespace the testbed does not own (the underlay
    namespace of a VM's tunnels): only to open sockets there. Nothing here creates,
    changes or removes it."""
    with _coming_back():
        _enter(name)
        yield


def socket_in(name: str | None, family: int = socket.AF_INET,
              kind: int = socket.SOCK_DGRAM) -> socket.socket:
    """A socket of the named namespace (None: this thread's own), e.g. a UDP socket on a
    VM's underlay; nothing else in the namespace is touched."""
    if name is None:
        return socket.socket(family, kind)
    with inside_any(name):
        return socket.socket(family, kind)


def write_sysctls(name: str, sysctls: Mapping[str, str]) -> None:
    paths = {_sysctl_path(key): value for key, value in sysctls.items()}
    with inside(name):
        _write(paths)


def _write(paths: Mapping[str, str]) -> None:
    for path, value in paths.items():
        with open(path, "w") as fh:
            fh.write(value)


def _in_worker(fn: Callable[[], T]) -> T:
    """Run fn in a thread of its own and return (or raise) what it did. For work that
    moves the thread into namespaces it does not come back from (a mount namespace):
    the thread ends with fn, and its namespaces with it. The caller waits for it
    whatever happens (Ctrl-C included), as create_many does."""
    out: list = []
    done = threading.Event()

    def run() -> None:
        try:
            out.append((True, fn()))
        except BaseException as exc:    # noqa: BLE001 - handed to the calling thread
            out.append((False, exc))
        finally:
            done.set()

    worker = threading.Thread(target=run, name="testbed-netns-worker")
    worker.start()
    try:
        done.wait()
    except BaseException:
        _wait_whatever_happens(done)
        raise
    worker.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


def in_scratch_namespace(fn: Callable[[], T]) -> T:
    """fn's result, called in a new unnamed network namespace (to find out what a
    namespace other than the initial one offers). Nothing is named or mounted: the
    kernel frees the namespace as soon as the worker thread leaves it."""
    def work():
        with _coming_back():
            if _libc.unshare(CLONE_NEWNET) != 0:
                raise _libc_error("unshare(CLONE_NEWNET)")
            return fn()
    return _in_worker(work)


def with_sysfs(names: Sequence[str], fn: Callable[[str], object]) -> None:
    """Call fn(name) for each namespace with /sys showing that namespace's devices.

    sysfs shows the network devices of the namespace that mounted it, so, like `ip
    netns exec`, a worker thread takes a mount namespace of its own, makes every mount
    in it a slave (nothing it mounts propagates back to the machine's), then per
    namespace enters it and mounts a sysfs on /sys, calls fn, and unmounts it. The
    thread, and its mount namespace, end afterwards.
    """
    for name in names:
        _check(name)

    def work() -> None:
        with _coming_back():
            if _libc.unshare(CLONE_NEWNS) != 0:
                raise _libc_error("unshare(CLONE_NEWNS)")
            if _libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None) != 0:
                # Without this a mount below could propagate to the initial mount
                # namespace: stop before mounting anything.
                raise _libc_error("making / a slave mount in a private mount namespace")
            for name in names:
                _enter(name)
                if _libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None) != 0:
                    raise _libc_error(f"mounting sysfs for {name}")
                try:
                    fn(name)
                finally:
                    _libc.umount2(b"/sys", MNT_DETACH)
    _in_worker(work)


# ---------------------------------------------------------------- create, remove

def _share_run_dir() -> None:
    """`ip netns add`'s preamble: /run/netns is a shared mount, so the bind mounts
    made in it are seen by every mount namespace (done once; idempotent)."""
    os.makedirs(NETNS_RUN_DIR, mode=0o755, exist_ok=True)
    d = NETNS_RUN_DIR.encode()
    if _libc.mount(b"", d, b"none", MS_SHARED | MS_REC, None) == 0:
        return
    if _libc.mount(d, d, b"none", MS_BIND | MS_REC, None) != 0:
        raise _libc_error(f"bind-mounting {NETNS_RUN_DIR} on itself")
    if _libc.mount(b"", d, b"none", MS_SHARED | MS_REC, None) != 0:
        raise _libc_error(f"making {NETNS_RUN_DIR} a shared mount")


def create(name: str, sysctls: Mapping[str, str] | None = None) -> None:
    create_many([(name, sysctls or {})])


def create_many(specs: Sequence[tuple[str, Mapping[str, str]]],
                open_socket: Callable[[], socket.socket] | None = None
                ) -> dict[str, socket.socket]:
    """Create each (name, sysctls) namespace, in order, and set its sysctls.

    With `open_socket`, it is called inside each new namespace and the sockets are
    returned by name (a socket keeps the namespace it was opened in). On failure
    raises NamespaceError; namespaces made before it stay, for the caller to remove
    (their names were known before: the builder records them first).
    """
    plans = []
    for name, sysctls in specs:
        _check(name)
        try:
            plans.append((name, {_sysctl_path(k): v for k, v in sysctls.items()}))
        except ValueError as exc:
            raise NamespaceError(name, "checking sysctls", exc) from None
    _share_run_dir()
    sockets: dict[str, socket.socket] = {}
    errors: list[BaseException] = []
    stop, done = threading.Event(), threading.Event()
    worker = threading.Thread(target=_create_worker, name="testbed-netns",
                              args=(plans, open_socket, sockets, errors, stop, done))
    worker.start()
    try:
        done.wait()
        worker.join()       # it has finished its work; this only lets the thread end
    except BaseException:
        # Ctrl-C (or a signal handler raising): let the worker finish the namespace it
        # is on and stop, so that no namespace appears after the caller cleans up.
        # (Not Thread.join: in Python 3.11 an interrupted join can mark a running
        # thread as stopped.)
        stop.set()
        _wait_whatever_happens(done)
        for sock in sockets.values():
            sock.close()
        raise
    if errors:
        for sock in sockets.values():
            sock.close()
        raise errors[0]
    return sockets


def _wait_whatever_happens(done: threading.Event) -> None:
    while True:
        with contextlib.suppress(BaseException):
            if done.wait():
                return


def _create_worker(plans, open_socket, sockets, errors, stop, done) -> None:
    try:
        home = _own_namespace()
        try:
            for name, paths in plans:
                if stop.is_set():
                    return
                sock = _create_one(name, paths, open_socket, home)
                if sock is not None:
                    sockets[name] = sock
        finally:
            os.close(home)
    except BaseException as exc:    # noqa: BLE001 - handed to the calling thread
        errors.append(exc)
    finally:
        done.set()      # after this the thread does nothing but end


def _create_one(name: str, paths: Mapping[str, str],
                open_socket: Callable[[], socket.socket] | None,
                home: int) -> socket.socket | None:
    """In the worker thread: make one namespace, enter it, set it up, come back."""
    path = _path(name)
    try:
        # The mount point, as iproute2 makes it; O_EXCL: never adopt someone else's.
        os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0))
    except OSError as exc:
        raise NamespaceError(name, f"creating {path}", exc) from exc
    step = "unshare(CLONE_NEWNET)"
    if _libc.unshare(CLONE_NEWNET) != 0:
        error = _libc_error(step)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise NamespaceError(name, step, error)
    try:
        step = f"bind-mounting it on {path}"
        if _libc.mount(b"/proc/thread-self/ns/net", path.encode(), b"none", MS_BIND,
                       None) != 0:
            error = _libc_error("mount")
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise NamespaceError(name, step, error)
        step = "writing sysctls"
        _write(paths)
        step = "opening a socket inside"
        return open_socket() if open_socket is not None else None
    except NamespaceError:
        raise
    except BaseException as exc:
        raise NamespaceError(name, step, exc) from exc
    finally:
        _return_to(home)


def remove(name: str) -> None:
    _check(name)
    path = _path(name)
    if not os.path.exists(path):
        return
    # Like `ip netns delete`: detach the bind mount, remove the file. The kernel frees
    # the namespace (and its veth ends, and their peers) once nothing holds it.
    _libc.umount2(path.encode(), MNT_DETACH)
    with contextlib.suppress(FileNotFoundError):     # removed meanwhile by someone else
        os.unlink(path)
