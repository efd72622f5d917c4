"""Kernel Soft-RoCE (rdma_rxe) endpoints: where a host's rxe device lives, and building it.

A host with `endpoint: rxe` gets one rxe device, DEVICE = `rxe_<lab>_<host>` (rdma devices
are machine-wide in the kernel's default "shared" rdma netns mode, so the lab is part of
the name). Its NIC keeps its port program, HTB classes and PFC agent exactly as any host's:
every RoCE packet of the device leaves and enters through that NIC. Two placements, chosen
by probing the running kernel (`probe_netns_aware`):

- NETNS_AWARE (Linux 7.1+, where rxe opens its UDP socket in the namespace of its netdev):
  `rdma link add DEVICE type rxe netdev <nic>` inside the host's namespace; the NIC's
  address and routes stay as the plan builds them; perftest runs in the host namespace.
- INITIAL_NS (older kernels: rxe's UDP socket on port 4791 lives only in the initial
  namespace, so an rxe link inside a namespace shows ACTIVE and passes nothing): the host
  namespace keeps its NIC without an address (default route `via <leaf> onlink`, static
  neighbour); an ipvlan L2 slave of the NIC (same MAC), SLAVE = `tbrxe<8 hex>`, is moved to
  the initial namespace with the host's plan address /32, a policy rule
  `pref RULE_PREF_BASE+i from ADDR iif lo lookup TABLE_BASE+i` whose table routes
  `default via <leaf> dev SLAVE onlink` (static neighbour), accept_local=1 and rp_filter=0 on
  the slave, all.rp_filter=0, and the `local` rule moved from pref 0 to LOCAL_RULE_PREF (so a
  packet from one rxe host to another leaves through the fabric instead of loopback); then
  `rdma link add DEVICE type rxe netdev SLAVE`. perftest runs in the initial namespace. (L3
  mode does not work: rxe loops a packet back when the next hop's MAC is its own.) This
  touches the initial namespace, so it is allowed only where the environment says that
  namespace belongs to the run (TESTBED_VM=1, set by VM mode in the guest); elsewhere the
  build is refused before anything is made.

What is made in the initial namespace is recorded before it is made, in the lab's state
directory (`rxe.json`), and the machine-wide settings changed once for all labs (the moved
local rule, all.rp_filter) with their old values in MACHINE_STATE; `destroy` removes it all,
and `destroy_orphans` finds what a SIGKILLed run left from names alone (SLAVE_PREFIX links,
rules into the TABLE_BASE range).

The placement facts other parts build on (the DCQCN agents of rxe-cc, the perftest kind,
the collector) are the pure part at the top: `RxePlacement`, `placement_of`,
`lab_placements`. Only testbed/net calls the kernel part below it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from testbed.plan.model import NodePlan, Plan

# ---- placement facts (pure) ---------------------------------------------------------------

NETNS_AWARE = "netns"       # the rxe device on the host NIC, inside the host namespace
INITIAL_NS = "initial"      # on an ipvlan-L2 slave of the NIC in the initial namespace
GID_INDEX = 1               # the RoCEv2 IPv4 GID of an rxe port (index 0 is the IPv6 link-local)
ROCE_UDP_PORT = 4791
SLAVE_PREFIX = "tbrxe"      # ipvlan slaves in the initial namespace: tbrxe<8 hex>
TABLE_BASE = 4791000        # routing tables of the initial-namespace placement: one per host
TABLE_COUNT = 1000
RULE_PREF_BASE = 1000       # their policy rules, below LOCAL_RULE_PREF
LOCAL_RULE_PREF = 2000      # where the `local` rule moves from pref 0
VM_ENV = "TESTBED_VM"       # "1": the initial namespace belongs to the run (VM mode's guest)
NETNS_AWARE_SINCE = (7, 1)  # the first Linux release whose rxe opens its socket per namespace


@dataclass(frozen=True)
class RxePlacement:
    """Where one rxe host's device is and what it is bound to."""

    host: str                 # node name
    device: str               # the ib device: perftest -d, /sys/class/infiniband/<device>
    nic: str                  # the host's NIC in its namespace (port program, HTB, PFC agent)
    host_netns: str           # the host's namespace, where `nic` is
    netdev: str               # what rxe is bound to: `nic` (NETNS_AWARE) or the ipvlan slave
    netdev_netns: str | None  # namespace of `netdev` and of perftest; None: the initial one
    address: str              # the host's plan address, no prefix (its RoCEv2 GID)
    gateway: str              # the NIC's /31 peer (the leaf port)
    gateway_mac: str          # that port's MAC (static neighbour)
    mode: str                 # NETNS_AWARE or INITIAL_NS
    table: int = 0            # INITIAL_NS: the host's routing table and rule preference
    rule_pref: int = 0


def device_name(lab: str, host: str) -> str:
    return f"rxe_{lab}_{host}"


def slave_name(lab: str, host: str) -> str:
    """The ipvlan slave of `host`'s NIC in the initial namespace (15 bytes at most)."""
    return SLAVE_PREFIX + hashlib.sha256(f"{lab}/{host}".encode()).hexdigest()[:8]


def rxe_hosts(plan: Plan) -> list[NodePlan]:
    return [n for n in plan.hosts() if n.endpoint == "rxe"]


def placement_of(plan: Plan, host: str, mode: str, slot: int = 0) -> RxePlacement:
    """The placement of rxe host `host` in `mode`; `slot` numbers its table and rule
    (INITIAL_NS), unique on the machine (`build` picks free ones)."""
    node = plan.node(host)
    nic = node.interfaces[0]
    peer = plan.node(nic.peer.node)
    gw_mac = next(i.mac for i in peer.interfaces if i.ifname == nic.peer.ifname)
    initial = mode == INITIAL_NS
    return RxePlacement(
        host=host, device=device_name(plan.lab, host), nic=nic.ifname, host_netns=node.netns,
        netdev=slave_name(plan.lab, host) if initial else nic.ifname,
        netdev_netns=None if initial else node.netns, address=nic.address.split("/")[0],
        gateway=nic.peer.address.split("/")[0], gateway_mac=gw_mac, mode=mode,
        table=TABLE_BASE + slot if initial else 0,
        rule_pref=RULE_PREF_BASE + slot if initial else 0)


def hw_counters_dir(device: str) -> Path:
    return Path("/sys/class/infiniband") / device / "ports" / "1" / "hw_counters"


#: files of hw_counters/ that are settings, not counters
NOT_COUNTERS = frozenset({"lifespan"})


def parse_hw_counters(files: Mapping[str, str]) -> dict[str, int]:
    """rxe's hw_counters (file name -> its text, one integer each) as counters by name,
    sorted; `lifespan` (how long the kernel caches them, a setting) and anything that is
    not one integer are left out."""
    out: dict[str, int] = {}
    for name, text in sorted(files.items()):
        if name in NOT_COUNTERS:
            continue
        value = text.strip()
        if re.fullmatch(r"\d+", value):
            out[name] = int(value)
    return out


def read_hw_counters(directory: Path) -> dict[str, int]:
    """parse_hw_counters over a hw_counters directory (empty if it is not there)."""
    files: dict[str, str] = {}
    try:
        entries = list(directory.iterdir())
    except OSError:
        return {}
    for path in entries:
        try:
            files[path.name] = path.read_text()
        except OSError:
            continue
    return parse_hw_counters(files)


class RxeRefused(RuntimeError):
    """This machine cannot place the plan's rxe hosts (said before anything is built)."""


def kernel_release_netns_aware(release: str) -> bool:
    """Whether a kernel release string is at least NETNS_AWARE_SINCE (a hint only: the
    probe decides, because distributions backport)."""
    m = re.match(r"(\d+)\.(\d+)", release)
    if m is None:
        return False
    return (int(m[1]), int(m[2])) >= NETNS_AWARE_SINCE


def choose_mode(netns_aware: bool, kernel: str, env: Mapping[str, str]) -> str:
    """NETNS_AWARE where the kernel is; else INITIAL_NS if the initial namespace belongs to
    the run (env TESTBED_VM=1); else RxeRefused saying why and what to do."""
    if netns_aware:
        return NETNS_AWARE
    if env.get(VM_ENV) == "1":
        return INITIAL_NS
    raise RxeRefused(
        f"endpoint: rxe: kernel {kernel}'s rdma_rxe is not network-namespace aware (before "
        "Linux 7.1 rxe opens its UDP socket 4791 only in the initial namespace, so an rxe "
        "device inside a host's namespace passes no traffic), and placing it in the initial "
        "namespace would change this machine's own network, which the testbed never touches; "
        "run it in a VM with `testbed run --vm`")


# ---- the kernel part ----------------------------------------------------------------------

MACHINE_STATE_NAME = "rxe-initns.json"   # beside the labs' directories (state_dir()/..)


def _labs_dir() -> Path:
    from testbed.net.state import state_dir
    return state_dir()


def machine_state_path() -> Path:
    return _labs_dir().parent / MACHINE_STATE_NAME


@dataclass
class RxeState:
    """What a lab's rxe hosts made, recorded before it is made."""

    lab: str
    mode: str
    placements: list[dict] = field(default_factory=list)   # asdict(RxePlacement)

    @staticmethod
    def path_of(lab: str) -> Path:
        return _labs_dir() / lab / "rxe.json"

    def save(self) -> None:
        path = self.path_of(self.lab)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, lab: str) -> RxeState | None:
        try:
            data = json.loads(cls.path_of(lab).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return cls(**data)

    def remove(self) -> None:
        self.path_of(self.lab).unlink(missing_ok=True)


def lab_placements(lab: str) -> list[RxePlacement]:
    """The placements of a built lab's rxe hosts (empty: none, or not built)."""
    state = RxeState.load(lab)
    return [RxePlacement(**p) for p in state.placements] if state else []


class RxeError(RuntimeError):
    """A step of building an rxe endpoint failed: which, and what the tool said."""


def _run(argv: list[str], what: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=60)
    if check and proc.returncode != 0:
        raise RxeError(f"{what}: `{' '.join(argv)}` exited {proc.returncode}: "
                       f"{(proc.stderr or proc.stdout).strip()[-300:]}")
    return proc


def load_modules() -> str:
    """modprobe what rxe needs (crc32_generic first: without it rxe fails with "failed to
    init crc32 algorithm"), ipvlan, veth; '' or what modprobe said."""
    if shutil.which("modprobe") is None:
        return "no modprobe"
    said = []
    for mod in ("crc32_generic", "rdma_rxe", "ipvlan"):
        p = subprocess.run(["modprobe", mod], capture_output=True, text=True,
                           stdin=subprocess.DEVNULL, timeout=60)
        if p.returncode != 0:
            said.append(f"{mod}: {p.stderr.strip()[-120:]}")
    return "; ".join(said)


@dataclass(frozen=True)
class RxeProbe:
    rxe: tuple[bool, str]
    netns_aware: tuple[bool, str]
    ipvlan: tuple[bool, str]


_PROBED: RxeProbe | None = None


def probe(refresh: bool = False) -> RxeProbe:
    """rdma_rxe (loadable: an rxe link can be added in a scratch namespace), whether it is
    namespace aware (that namespace's /proc/net/udp then lists port 4791), ipvlan. Cached
    per process."""
    global _PROBED
    if _PROBED is not None and not refresh:
        return _PROBED
    from testbed.net import namespaces
    load_modules()
    ns = f"{namespaces.PREFIX}rxeprobe-{os.getpid()}"
    rxe = (False, "not probed")
    aware = (False, "not probed: no rdma_rxe")
    ipvlan = (False, "not probed")
    have_rdma = shutil.which("rdma") is not None
    try:
        namespaces.create(ns)
    except Exception as exc:   # a probe reports, it does not crash
        return RxeProbe((False, f"no scratch namespace: {exc}"), aware, (False, str(exc)))
    try:
        ex = ["ip", "netns", "exec", ns]
        _run(["ip", "-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1"], "veth")
        _run(["ip", "-n", ns, "link", "set", "p0", "up"], "link up")
        p = _run(["ip", "-n", ns, "link", "add", "link", "p0", "name", "iv0", "type", "ipvlan",
                  "mode", "l2"], "ipvlan", check=False)
        ipvlan = (p.returncode == 0, "ok" if p.returncode == 0 else
                  f"not in this kernel ({p.stderr.strip()[-120:]})")
        if not have_rdma:
            rxe = (False, "the rdma tool (iproute2) is not installed")
        else:
            dev = f"tbprobe{os.getpid() % 100000}"
            p = _run([*ex, "rdma", "link", "add", dev, "type", "rxe", "netdev", "p0"], "rxe",
                     check=False)
            if p.returncode != 0:
                rxe = (False, f"not in this kernel (rdma link add: {p.stderr.strip()[-120:]})")
            else:
                rxe = (True, "ok (rdma link add in a scratch namespace)")
                udp = _run([*ex, "cat", "/proc/net/udp"], "udp").stdout
                listening = any(line.split()[1].endswith(":12B7") for line in
                                udp.splitlines()[1:] if len(line.split()) > 1)
                aware = (listening, "rxe listens on 4791 in the link's namespace" if listening
                         else f"kernel {platform.release()}: rxe's UDP socket is in the "
                              "initial namespace only")
                _run([*ex, "rdma", "link", "del", dev], "rxe del", check=False)
    except Exception as exc:
        rxe = rxe if rxe[0] else (False, str(exc))
    finally:
        namespaces.remove(ns)
    _PROBED = RxeProbe(rxe, aware, ipvlan)
    return _PROBED


def placement_mode(plan: Plan, env: Mapping[str, str] | None = None) -> str | None:
    """The mode this machine places the plan's rxe hosts in (None: no rxe hosts), or
    RxeRefused before anything is built."""
    if not rxe_hosts(plan):
        return None
    found = probe()
    if not found.rxe[0]:
        raise RxeRefused(f"endpoint: rxe needs rdma_rxe, which kernel {platform.release()} "
                         f"lacks ({found.rxe[1]}); run it in a VM with `testbed run --vm`")
    mode = choose_mode(found.netns_aware[0], platform.release(),
                       os.environ if env is None else env)
    if mode == INITIAL_NS and not found.ipvlan[0]:
        raise RxeRefused(f"endpoint: rxe on kernel {platform.release()} needs ipvlan (the "
                         f"initial-namespace placement), which it lacks ({found.ipvlan[1]})")
    return mode


def _free_slots(count: int) -> list[int]:
    """`count` table/rule slots no rule of the initial namespace uses."""
    used = set()
    out = _run(["ip", "-j", "rule", "show"], "ip rule", check=False).stdout
    for rule in json.loads(out or "[]"):
        table = rule.get("table")
        if isinstance(table, str) and table.isdigit():
            table = int(table)
        if isinstance(table, int) and TABLE_BASE <= table < TABLE_BASE + TABLE_COUNT:
            used.add(table - TABLE_BASE)
    for state_file in _labs_dir().glob("*/rxe.json"):
        try:
            for p in json.loads(state_file.read_text()).get("placements", []):
                if p.get("table"):
                    used.add(p["table"] - TABLE_BASE)
        except (OSError, json.JSONDecodeError):
            continue
    free = [s for s in range(TABLE_COUNT) if s not in used][:count]
    if len(free) < count:
        raise RxeError(f"no free routing tables left in {TABLE_BASE}..")
    return free


def build(plan: Plan, mode: str, say=lambda _m: None) -> list[RxePlacement]:
    """Make every rxe host's device (after the fabric is built: NICs up, routes in)."""
    hosts = rxe_hosts(plan)
    if not hosts:
        return []
    load_modules()
    slots = _free_slots(len(hosts)) if mode == INITIAL_NS else [0] * len(hosts)
    placements = [placement_of(plan, h.name, mode, s) for h, s in zip(hosts, slots, strict=True)]
    RxeState(plan.lab, mode, [asdict(p) for p in placements]).save()   # before making it
    if mode == INITIAL_NS:
        _machine_settings_on()
    for p in placements:
        where = (f"initial namespace, ipvlan {p.netdev}" if mode == INITIAL_NS
                 else "in its namespace")
        say(f"rxe {p.device} on {p.host}:{p.nic} ({where})")
        if mode == INITIAL_NS:
            _place_initial(plan, p)
        else:
            _run(["ip", "netns", "exec", p.host_netns, "rdma", "link", "add", p.device, "type",
                  "rxe", "netdev", p.nic], f"rxe device of {p.host}")
    return placements


def _place_initial(plan: Plan, p: RxePlacement) -> None:
    ns = p.host_netns
    nic = plan.node(p.host).interfaces[0]
    n = ["ip", "-n", ns]
    # The host namespace: its NIC without an address (the slave has it), a default route
    # and the leaf as a static neighbour (deleting the last address flushes both).
    _run([*n, "addr", "del", nic.address, "dev", p.nic], f"{p.host}: address off its NIC")
    _run([*n, "neigh", "replace", p.gateway, "lladdr", p.gateway_mac, "dev", p.nic, "nud",
          "permanent"], f"{p.host}: neighbour")
    _run([*n, "route", "replace", "default", "via", p.gateway, "dev", p.nic, "onlink"],
         f"{p.host}: default route")
    _run([*n, "link", "add", "link", p.nic, "name", p.netdev, "type", "ipvlan", "mode", "l2"],
         f"{p.host}: ipvlan slave")
    _run([*n, "link", "set", p.netdev, "netns", "1"], f"{p.host}: slave to the initial namespace")
    # The initial namespace (the VM's: VM_ENV said so).
    conf = Path("/proc/sys/net/ipv4/conf") / p.netdev
    (conf / "accept_local").write_text("1\n")
    (conf / "rp_filter").write_text("0\n")
    _run(["ip", "addr", "add", f"{p.address}/32", "dev", p.netdev], f"{p.host}: slave address")
    _run(["ip", "link", "set", p.netdev, "up"], f"{p.host}: slave up")
    _run(["ip", "neigh", "replace", p.gateway, "lladdr", p.gateway_mac, "dev", p.netdev, "nud",
          "permanent"], f"{p.host}: slave neighbour")
    _run(["ip", "route", "replace", "default", "via", p.gateway, "dev", p.netdev, "onlink",
          "table", str(p.table)], f"{p.host}: table {p.table}")
    _run(["ip", "rule", "add", "pref", str(p.rule_pref), "from", p.address, "iif", "lo",
          "lookup", str(p.table)], f"{p.host}: rule")
    _run(["rdma", "link", "add", p.device, "type", "rxe", "netdev", p.netdev],
         f"rxe device of {p.host}")


def _local_rule_prefs() -> list[int]:
    out = _run(["ip", "-j", "rule", "show"], "ip rule", check=False).stdout
    return [int(r.get("priority", -1)) for r in json.loads(out or "[]")
            if r.get("table") == "local" and r.get("src") in (None, "all")]


def _machine_settings_on() -> None:
    """Once for every lab: all.rp_filter=0 and the local rule below the rxe rules, their
    old values kept in MACHINE_STATE first."""
    path = machine_state_path()
    if path.exists():
        return
    rp = Path("/proc/sys/net/ipv4/conf/all/rp_filter")
    old = {"all_rp_filter": rp.read_text().strip(), "local_rule_prefs": _local_rule_prefs()}
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.write_text(json.dumps(old) + "\n")
    rp.write_text("0\n")
    if LOCAL_RULE_PREF not in old["local_rule_prefs"]:
        _run(["ip", "rule", "add", "pref", str(LOCAL_RULE_PREF), "lookup", "local"], "local rule")
    if 0 in old["local_rule_prefs"]:
        _run(["ip", "rule", "del", "pref", "0", "lookup", "local"], "local rule")


def _machine_settings_off() -> None:
    path = machine_state_path()
    try:
        old = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return
    prefs = _local_rule_prefs()
    if 0 in old.get("local_rule_prefs", [0]) and 0 not in prefs:
        _run(["ip", "rule", "add", "pref", "0", "lookup", "local"], "local rule back", check=False)
    if LOCAL_RULE_PREF not in old.get("local_rule_prefs", []) and LOCAL_RULE_PREF in prefs:
        _run(["ip", "rule", "del", "pref", str(LOCAL_RULE_PREF), "lookup", "local"],
             "local rule back", check=False)
    try:
        Path("/proc/sys/net/ipv4/conf/all/rp_filter").write_text(
            f"{old.get('all_rp_filter', '0')}\n")
    except OSError:
        pass
    path.unlink(missing_ok=True)


def device_holders(device: str) -> list[int]:
    """Pids holding the device's uverbs character device open. `rdma link del` waits,
    uninterruptibly, until every one of them has closed it."""
    chardevs = set()
    for ibdev in Path("/sys/class/infiniband_verbs").glob("uverbs*/ibdev"):
        try:
            if ibdev.read_text().strip() == device:
                chardevs.add(f"/dev/infiniband/{ibdev.parent.name}")
        except OSError:
            continue
    pids = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) in chardevs for fd in fd_dir.iterdir()):
                pids.append(int(fd_dir.parent.name))
        except OSError:
            continue
    return sorted(pids)


def _remove_placement(p: RxePlacement) -> None:
    holders = device_holders(p.device)
    if holders:
        # Never block `down` on a device in use: deleting it would wait for them.
        raise RxeError(f"rxe device {p.device} is held open by pids "
                       f"{', '.join(map(str, holders))} (perftest?); end them, then run "
                       "`testbed down` again")
    if shutil.which("rdma"):
        _run(["rdma", "link", "del", p.device], "rxe del", check=False)
    if p.mode != INITIAL_NS:
        return
    _run(["ip", "link", "del", p.netdev], "slave del", check=False)
    _run(["ip", "rule", "del", "pref", str(p.rule_pref), "lookup", str(p.table)], "rule del",
         check=False)
    _run(["ip", "route", "flush", "table", str(p.table)], "table flush", check=False)


def destroy(lab: str) -> None:
    """Remove what `build` made for the lab (before its namespaces go), and the machine-wide
    settings once no lab needs them."""
    state = RxeState.load(lab)
    if state is None:
        return
    for p in lab_placements(lab):
        _remove_placement(p)
    state.remove()
    if not any(_labs_dir().glob("*/rxe.json")):
        _machine_settings_off()


def destroy_orphans() -> list[str]:
    """After every lab's state is gone (down --all): what a killed run left in the initial
    namespace, from names alone: SLAVE_PREFIX links, rules into the TABLE_BASE range and
    their tables, then the machine-wide settings. Returns what was removed."""
    if any(_labs_dir().glob("*/rxe.json")):
        return []
    removed: list[str] = []
    links = _run(["ip", "-j", "link", "show"], "ip link", check=False).stdout
    for link in json.loads(links or "[]"):
        name = link.get("ifname", "")
        if name.startswith(SLAVE_PREFIX):
            _run(["ip", "link", "del", name], "slave del", check=False)
            removed.append(f"initial-namespace ipvlan {name}")
    rules = _run(["ip", "-j", "rule", "show"], "ip rule", check=False).stdout
    for rule in json.loads(rules or "[]"):
        table = str(rule.get("table", ""))
        if table.isdigit() and TABLE_BASE <= int(table) < TABLE_BASE + TABLE_COUNT:
            _run(["ip", "rule", "del", "pref", str(rule["priority"]), "lookup", table],
                 "rule del", check=False)
            _run(["ip", "route", "flush", "table", table], "table flush", check=False)
            removed.append(f"initial-namespace rule {rule['priority']} (table {table})")
    if machine_state_path().exists():
        _machine_settings_off()
        removed.append("initial-namespace local rule and all.rp_filter restored")
    return removed
