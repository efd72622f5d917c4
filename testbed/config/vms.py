"""The VMs file: the machines one fabric is spread over (`testbed plan FILE --vms VMS.yaml`).

Each VM has a name (its Ansible inventory name), the IPv4 address of its underlay interface
(where the VXLAN tunnels of the links that cross VMs end), its cores, the wall rate it was
measured to carry with fidelity, and optionally its underlay interface's MTU (what
Ansible's facts report). File-wide settings tune the partition (testbed/plan/partition.py).
docs/scale-out.md describes every field.

Loaded like a fabric config: strict models (an unknown field is an error), every problem
at once as `FILE:LINE: path.to.field: message`. What needs the fabric as well (the
underlay MTU against the fabric's MTU, VNIs against the number of links, nodes against
the VMs' cores) is `check_vms_for_fabric`, run before anything is partitioned.

Regenerate the editors' schema with

    python -m testbed.config.vms > configs/schema/vms.schema.json
"""

from __future__ import annotations

import ipaddress
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import BeforeValidator, Field, ValidationError, WithJsonSchema

from testbed.config import ConfigError, Problem, pydantic_problems, read_config_file
from testbed.config.loader import (
    LineMap,
    YamlProblem,
    parse_yaml_with_lines,
)
from testbed.fields import RateBps, Strict

VMS_FORMAT_VERSION = 1
VM_NAME_RE = r"^[a-z0-9][a-z0-9_.-]{0,62}$"

# A fabric packet that crosses VMs is the port's Ethernet frame inside VXLAN inside UDP
# inside the underlay's IPv4 packet (RFC 7348): outer IPv4 header 20 + UDP 8 + VXLAN 8 +
# the inner frame's Ethernet header 14 = 50 bytes on top of the fabric's IP MTU. (No inner
# VLAN tag: traffic classes travel in DSCP, and PFC frames are untagged MAC control.)
VXLAN_OVERHEAD_BYTES = 20 + 8 + 8 + 14
VXLAN_UDP_PORT = 4789                   # IANA's VXLAN port (RFC 7348)
MAX_VNI = 2**24 - 1                     # VNIs are 24 bits; 0 is left unused
FABRIC_MIN_MTU_BYTES = 1280             # the fabric config's own floor for `mtu:`
ROCE_MTUS = (4096, 2048, 1024, 512, 256)
ROCE_HEADROOM_BYTES = 80                # roce_mtu needs mtu >= roce_mtu + 80 (rxe's rule)


def _ipv4_underlay(value: object) -> object:
    if isinstance(value, str):
        try:
            address = ipaddress.ip_address(value.strip())
        except ValueError:
            raise ValueError(f"{value!r} is not an IP address; write the VM's underlay "
                             "IPv4 address, like 192.0.2.11") from None
        if address.version == 6:
            raise ValueError(f"{value!r} is IPv6; the underlay must be IPv4 (the MTU rule "
                             f"counts {VXLAN_OVERHEAD_BYTES} bytes of IPv4 VXLAN overhead)")
        return address
    raise ValueError(f"expected the VM's underlay IPv4 address as text, like 192.0.2.11, "
                     f"got {value!r}")


UnderlayAddress = Annotated[
    ipaddress.IPv4Address, BeforeValidator(_ipv4_underlay),
    WithJsonSchema({"type": "string", "format": "ipv4",
                    "description": "the VM's underlay IPv4 address"})]


class Vm(Strict):
    """One VM: where its part of the fabric runs and how much it can carry."""

    name: str = Field(pattern=VM_NAME_RE, description="the VM's name (its Ansible inventory "
                                                      "name), unique")
    underlay: UnderlayAddress = Field(
        description="IPv4 address of the VM's underlay interface: the local end of its VXLAN "
                    "tunnels, the remote end of its peers' tunnels; unique")
    cores: int = Field(ge=1, le=4096, description="CPU cores of the VM; with nodes_per_core "
                                                  "they cap how many nodes it takes")
    wall_rate_budget_bps: RateBps = Field(
        alias="wall_rate_budget",
        description="the wall rate the VM was measured to carry with fidelity: the sum over "
                    "its ports (every node's egress ports and its tunnels' ends) of their "
                    "dilated rates; the partition shares the fabric's load in proportion")
    mtu_bytes: int | None = Field(
        None, alias="mtu", ge=576, le=65535,
        description="MTU of the VM's underlay interface (Ansible's ansible_<if>.mtu fact); "
                    "checked against the fabric's mtu + 50 bytes of VXLAN overhead")


class VmsFile(Strict):
    """The VMs a fabric is spread over, and the partition's settings."""

    vms: list[Vm] = Field(min_length=1, description="the VMs, in the order VMs are tried "
                                                    "(the first gets the first nodes at a tie)")
    vni_base: int = Field(10000, ge=1, le=MAX_VNI,
                          description="VNI of the tunnel of plan link 0; link i gets "
                                      "vni_base + i (labs sharing VMs need disjoint ranges)")
    imbalance: float = Field(0.1, ge=0, le=10,
                             description="how far above its share (of the load, in proportion "
                                         "to its budget) a VM may go before balance outweighs "
                                         "cut links: 0.1 = 10 %")
    nodes_per_core: int = Field(8, ge=1, le=1000,
                                description="nodes (namespaces with their agents) a VM takes "
                                            "per core, at most")


@dataclass(frozen=True)
class LoadedVms:
    path: str
    vms_file: VmsFile
    lines: LineMap


def _duplicates(vms_file: VmsFile) -> list[tuple[tuple, str]]:
    found: list[tuple[tuple, str]] = []
    names: dict[str, int] = {}
    underlays: dict[ipaddress.IPv4Address, int] = {}
    for i, vm in enumerate(vms_file.vms):
        if vm.name in names:
            found.append((("vms", i, "name"), f"VM name {vm.name!r} is already vms"
                                             f"[{names[vm.name]}]'s; give each VM its own"))
        names.setdefault(vm.name, i)
        if vm.underlay in underlays:
            found.append((("vms", i, "underlay"),
                          f"underlay {vm.underlay} is already vms[{underlays[vm.underlay]}]'s "
                          "address; each VM's tunnels need their own end"))
        underlays.setdefault(vm.underlay, i)
    return found


def validate_vms_data(data: object, lines: LineMap, file: str) -> LoadedVms:
    """Parsed YAML -> LoadedVms; ConfigError with every problem."""
    if not isinstance(data, dict):
        what = "nothing" if data is None else "a list" if isinstance(data, list) else repr(data)
        raise ConfigError(file, [Problem(1, (), f"the file holds {what}, but a VMs file is a "
                                                "mapping with vms: (a list of VMs)")])
    try:
        vms_file = VmsFile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(file, pydantic_problems(exc, data, lines, VmsFile)) from None
    found = _duplicates(vms_file)
    if found:
        raise ConfigError(file, [Problem(lines.line_for(loc), loc, m) for loc, m in found])
    return LoadedVms(path=file, vms_file=vms_file, lines=lines)


def load_vms_text(text: str, file: str = "<string>") -> LoadedVms:
    try:
        data, lines = parse_yaml_with_lines(text)
    except YamlProblem as exc:
        raise ConfigError(file, [Problem(exc.line, exc.loc, exc.message)]) from None
    return validate_vms_data(data, lines, file)


def load_vms(path: str | Path) -> LoadedVms:
    """Load and validate a VMs file."""
    return load_vms_text(read_config_file(path), str(path))


def underlay_mtu_bytes(fabric_mtu_bytes: int) -> int:
    """The underlay IP MTU a tunnel of a fabric with this MTU needs."""
    return fabric_mtu_bytes + VXLAN_OVERHEAD_BYTES


def _roce_mtu_for(mtu_bytes: int) -> int | None:
    return next((r for r in ROCE_MTUS if r + ROCE_HEADROOM_BYTES <= mtu_bytes), None)


def vms_fabric_problems(vms_file: VmsFile, *, fabric_file: str, fabric_mtu_bytes: int,
                        roce_mtu_bytes: int, n_links: int,
                        n_nodes: int) -> list[tuple[tuple, str]]:
    """(location in the VMs file, message) for each thing the VMs cannot do for this
    fabric: an underlay MTU too small for the fabric's MTU plus VXLAN's overhead, VNIs
    beyond 24 bits, more nodes than the VMs' cores take."""
    found: list[tuple[tuple, str]] = []
    need = underlay_mtu_bytes(fabric_mtu_bytes)
    given = [vm.mtu_bytes for vm in vms_file.vms if vm.mtu_bytes is not None]
    lowered = min(given) - VXLAN_OVERHEAD_BYTES if given else 0
    for i, vm in enumerate(vms_file.vms):
        if vm.mtu_bytes is None or vm.mtu_bytes >= need:
            continue
        fixes = []
        if lowered >= FABRIC_MIN_MTU_BYTES:
            roce = _roce_mtu_for(lowered)
            also = (f" and roce_mtu: to {roce}" if roce is not None and roce < roce_mtu_bytes
                    else "")
            fixes.append(f"lower the fabric's mtu: to {lowered}{also} in {fabric_file}")
        fixes.append(f"raise {vm.name}'s underlay MTU to {need}")
        found.append((("vms", i, "mtu"),
                      f"{vm.name}'s underlay MTU {vm.mtu_bytes} is too small for the fabric's "
                      f"MTU {fabric_mtu_bytes}: a VXLAN tunnel needs {need} ({fabric_mtu_bytes}"
                      f" + {VXLAN_OVERHEAD_BYTES} bytes: outer IPv4 20, UDP 8, VXLAN 8, inner "
                      f"Ethernet 14); {', or '.join(fixes)}"))
    last_vni = vms_file.vni_base + max(n_links - 1, 0)
    if last_vni > MAX_VNI:
        found.append((("vni_base",), f"vni_base {vms_file.vni_base} + {n_links - 1} (the "
                                     f"fabric's last link) is {last_vni}, beyond the 24-bit "
                                     f"VNI {MAX_VNI}; use a vni_base <= {MAX_VNI - n_links + 1}"))
    room = sum(vm.cores for vm in vms_file.vms) * vms_file.nodes_per_core
    if n_nodes > room:
        found.append((("vms",), f"the fabric's {n_nodes} nodes do not fit: the VMs' "
                                f"{sum(vm.cores for vm in vms_file.vms)} cores x nodes_per_core "
                                f"{vms_file.nodes_per_core} take {room}; add VMs or cores, or "
                                "raise nodes_per_core"))
    return found


def check_vms_for_fabric(loaded: LoadedVms, *, fabric_file: str, fabric_mtu_bytes: int,
                         roce_mtu_bytes: int, n_links: int, n_nodes: int) -> None:
    """ConfigError naming the VMs file's lines if these VMs cannot carry this fabric."""
    found = vms_fabric_problems(loaded.vms_file, fabric_file=fabric_file,
                                fabric_mtu_bytes=fabric_mtu_bytes, roce_mtu_bytes=roce_mtu_bytes,
                                n_links=n_links, n_nodes=n_nodes)
    if found:
        raise ConfigError(loaded.path, [Problem(loaded.lines.line_for(loc), loc, m)
                                        for loc, m in found])


SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def vms_schema() -> dict:
    schema = VmsFile.model_json_schema(by_alias=True, mode="validation")
    return {"$schema": SCHEMA_DIALECT, **schema, "title": "Fabric testbed VMs file",
            "description": (f"The VMs one fabric is spread over (VMs format "
                            f"{VMS_FORMAT_VERSION}), for `testbed plan FILE --vms VMS.yaml`. "
                            "Generated from testbed/config/vms.py; docs/scale-out.md "
                            "describes the fields.")}


def vms_schema_text() -> str:
    return json.dumps(vms_schema(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    sys.stdout.write(vms_schema_text())
