"""Expand a generated topology (`topology:`) into explicit nodes and links.

Pure: the same topology always yields the same names in the same order, so
plans are deterministic. Each generated item remembers the config location
it came from, so a problem with a generated link points at `topology.*`.
"""

from __future__ import annotations

from dataclasses import dataclass

from testbed.config.models import Fabric, LeafSpine, Link, LinkSpec, Node, Ring, SingleSwitch


@dataclass(frozen=True)
class Expanded:
    nodes: list[Node]
    links: list[Link]
    node_locs: list[tuple]   # config location of each node, for error messages
    link_locs: list[tuple]


def _link(a: str, b: str, spec: LinkSpec) -> Link:
    return Link(a=a, b=b, port=spec.port, length_m=spec.length_m, qos=spec.qos)


def _generate(
    topology: LeafSpine | SingleSwitch | Ring,
) -> tuple[list[Node], list[tuple[Link, str]]]:
    nodes: list[Node] = []
    links: list[tuple[Link, str]] = []
    if isinstance(topology, LeafSpine):
        spines = [f"spine{i}" for i in range(1, topology.spines + 1)]
        leaves = [f"leaf{i}" for i in range(1, topology.leaves + 1)]
        nodes += [Node(name=n, role="switch") for n in spines + leaves]
        host = 0
        for leaf in leaves:
            for _ in range(topology.hosts_per_leaf):
                host += 1
                nodes.append(Node(name=f"h{host}", role="host"))
                links.append((_link(f"h{host}", leaf, topology.host_link), "host_link"))
        for leaf in leaves:
            for spine in spines:
                links.append((_link(leaf, spine, topology.fabric_link), "fabric_link"))
    elif isinstance(topology, SingleSwitch):
        nodes.append(Node(name="sw1", role="switch"))
        for i in range(1, topology.hosts + 1):
            nodes.append(Node(name=f"h{i}", role="host"))
            links.append((_link(f"h{i}", "sw1", topology.host_link), "host_link"))
    else:
        switches = [f"sw{i}" for i in range(1, topology.switches + 1)]
        nodes += [Node(name=n, role="switch") for n in switches]
        host = 0
        for sw in switches:
            for _ in range(topology.hosts_per_switch):
                host += 1
                nodes.append(Node(name=f"h{host}", role="host"))
                links.append((_link(f"h{host}", sw, topology.host_link), "host_link"))
        for i, sw in enumerate(switches):
            links.append((_link(sw, switches[(i + 1) % len(switches)], topology.fabric_link),
                          "fabric_link"))
    return nodes, links


def expand(fabric: Fabric) -> Expanded:
    """All nodes and links of the fabric: generated ones first, then explicit ones."""
    nodes: list[Node] = []
    links: list[Link] = []
    node_locs: list[tuple] = []
    link_locs: list[tuple] = []
    if fabric.topology is not None:
        gen_nodes, gen_links = _generate(fabric.topology)
        nodes += gen_nodes
        node_locs += [("topology",)] * len(gen_nodes)
        for link, field in gen_links:
            links.append(link)
            link_locs.append(("topology", field))
    for i, node in enumerate(fabric.nodes):
        nodes.append(node)
        node_locs.append(("nodes", i))
    for i, link in enumerate(fabric.links):
        links.append(link)
        link_locs.append(("links", i))
    return Expanded(nodes=nodes, links=links, node_locs=node_locs, link_locs=link_locs)
