"""A sandbox's network end: its own network namespace, joined to the host by a veth pair (pyroute2,
no `ip` subprocess), addressed from the node's /16, its only route to the host end, where the node's
Aether rules (rules.py) send every connection to the proxy and every DNS query to Aether's resolver.

The namespace is made by the host (owned by the host's user namespace), so a sandbox's root, in a user
namespace of its own, has no CAP_NET_ADMIN over it: it cannot change its address, routes or rules.
Namespaces are made ahead into a pool, off the create path; the zygote joins one (setns) instead of
making a fresh one. A namespace lives while an fd holds it (ours, then the sandbox's init), and its
veth pair goes with it, so a dead edge leaks no link.

Each end is one /30 of the node's /16: the host end .1, the sandbox .2. A veth is named
dx<6 hex of the node id's crc32><slot in hex> (at most 12 characters), so two nodes on one host never
collide and leftovers name their node.
"""
from __future__ import annotations

import collections
import errno
import fcntl
import ipaddress
import logging
import os
import struct
import threading
import time
import zlib
from dataclasses import dataclass

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from edge.backends import kernel
from edge.backends.zygote import NET_SYSCTLS

log = logging.getLogger(__name__)

PREFIX = "dx"
SLOTS = 16383                      # /30s in a /16, less the first
POOL_BASE = ipaddress.IPv4Network("10.192.0.0/10")   # node subnets are /16s inside it
RESERVED_METRIC = 1 << 24        # + a node's tag: the metric of its reservation
UNREACHABLE = 7                    # RTN_UNREACHABLE
SANDBOX_SYSCTLS = (("net/ipv6/conf/all/disable_ipv6", "1"), ("net/ipv6/conf/default/disable_ipv6", "1"),
                   *NET_SYSCTLS)    # and what the zygote opens in a namespace of its own (low ports, ping)


class LinkError(Exception):
    """A sandbox's network end could not be made or removed."""


def node_tag(node: str) -> str:
    """6 hex digits naming the node in its links' names."""
    return f"{zlib.crc32(node.encode()) & 0xFFFFFF:06x}"


def link_prefix(node: str) -> str:
    """What the name of every host-side link of this node starts with."""
    return PREFIX + node_tag(node)


def route_mark(node: str) -> int:
    """The metric of the unreachable route that reserves a node's /16 (it names the node)."""
    return RESERVED_METRIC + int(node_tag(node), 16)


def host_routes() -> list[tuple[ipaddress.IPv4Network, int, int]]:
    """(destination, type, metric) of every IPv4 route of the host's main table but the default."""
    with IPRoute() as ipr:
        out = []
        for route in ipr.get_routes(family=2, table=254):
            dst, length = route.get_attr("RTA_DST"), route["dst_len"]
            if dst and length:
                out.append((ipaddress.IPv4Network(f"{dst}/{length}", strict=False), route["type"],
                            route.get_attr("RTA_PRIORITY") or 0))
        return out


def reserve_subnet(node: str) -> ipaddress.IPv4Network:
    """The node's /16, reserved on the host by an unreachable route of its mark (its sandboxes' /30s are
    more specific, so they route): the one it reserved before, else the first free one after its id's
    hash among POOL_BASE's, skipping any a host route overlaps (another node's, a network's)."""
    routes, mark = host_routes(), route_mark(node)
    for net, kind, metric in routes:
        if kind == UNREACHABLE and metric == mark and net.prefixlen == 16 and net.subnet_of(POOL_BASE):
            return net
    subnets = list(POOL_BASE.subnets(new_prefix=16))
    start = zlib.crc32(node.encode()) % len(subnets)
    for i in range(len(subnets)):
        net = subnets[(start + i) % len(subnets)]
        if not any(net.overlaps(taken) for taken, _, _ in routes):
            with IPRoute() as ipr:
                ipr.route("add", dst=str(net), type=UNREACHABLE, priority=mark)
            return net
    raise LinkError(f"no free /16 in {POOL_BASE} for node {node}'s sandboxes")


def release_subnet(node: str) -> None:
    """Drop the node's reservation (its sandboxes' links are gone)."""
    mark = route_mark(node)
    with IPRoute() as ipr:
        for net, kind, metric in host_routes():
            if kind == UNREACHABLE and metric == mark and net.subnet_of(POOL_BASE):
                ipr.route("del", dst=str(net), type=UNREACHABLE, priority=mark)


def reservations() -> dict[int, ipaddress.IPv4Network]:
    """Every node's reservation on this host by mark (the leak check's view)."""
    return {metric: net for net, kind, metric in host_routes()
            if kind == UNREACHABLE and metric >= RESERVED_METRIC and net.subnet_of(POOL_BASE)}


@dataclass
class End:
    """One sandbox's network: its namespace (fd held), slot and addresses."""

    slot: int
    netns: int                     # fd of the namespace; -1 once closed
    ifname: str                    # the host end
    gateway: str                   # host end's address: the sandbox's route, DNS server and proxy
    address: str                   # the sandbox's
    bandwidth: int = 0             # bytes/s each way its links are shaped to (0: not yet)

    def close(self) -> None:
        if self.netns >= 0:
            os.close(self.netns)
            self.netns = -1


class Links:
    """The node's sandbox network ends: made and configured on one thread (setns moves one thread only)."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.prefix = link_prefix(node)
        self.subnet = reserve_subnet(node)
        self._free = collections.deque(range(1, SLOTS + 1))   # first in, first out: a freed slot's
        self.freed: dict[str, float] = {}                      # link may linger a moment (see free)
        self._lock = threading.Lock()
        self.making: set[str] = set()      # host ends being made now (not yet handed to anyone)

    def close(self) -> None:
        """Drop the node's reservation (every End freed first)."""
        release_subnet(self.node)

    def addresses(self, slot: int) -> tuple[str, str]:
        """(host end, sandbox end) of a slot."""
        base = int(self.subnet.network_address) + 4 * slot
        return str(ipaddress.IPv4Address(base + 1)), str(ipaddress.IPv4Address(base + 2))

    def make(self) -> End:
        """A new namespace with its veth pair up and addressed. Blocking (~ms): call it off the event loop."""
        with self._lock:
            if not self._free:
                raise LinkError(f"node {self.node} holds {SLOTS} sandbox networks already")
            slot = self._free.popleft()
        gateway, address = self.addresses(slot)
        end = End(slot, -1, f"{self.prefix}{slot:x}", gateway, address)
        self.making.add(end.ifname)      # until its taker holds it (held(): off this thread)
        try:
            end.netns = _configure(end)
        except (OSError, NetlinkError) as exc:
            self.free(end)
            raise LinkError(f"sandbox network {end.ifname}: {exc}") from exc
        return end

    def held(self, end: End) -> None:
        """Its taker holds it now (the leak check counts it there)."""
        self.making.discard(end.ifname)

    def free(self, end: End) -> None:
        """Close our fd of the namespace and give the slot back. The namespace, and its veth pair with it, go
        when its last holder (the sandbox's init) is gone: the kernel tears namespaces down in batches off
        every caller's path, where deleting the link here would wait out an RCU grace period under the rtnl
        lock that creates need. Slots are reused oldest first, long after their link went."""
        end.close()
        self.making.discard(end.ifname)
        with self._lock:
            self._free.append(end.slot)
            self.freed[end.ifname] = time.monotonic()
            while len(self.freed) > 4096:
                self.freed.pop(next(iter(self.freed)))

    def lingering(self, within: float) -> set[str]:
        """Host ends freed less than `within` seconds ago (their links may not be gone yet)."""
        now = time.monotonic()
        return {name for name, at in self.freed.items() if now - at < within}

    def leftovers(self) -> list[str]:
        """Host links of this node's prefix (none once every End is freed)."""
        with IPRoute() as ipr:
            return sorted(name for link in ipr.get_links() if (name := link.get_attr("IFLA_IFNAME", ""))
                          .startswith(self.prefix))


def _configure(end: End) -> int:
    """Make the namespace on this thread, configure both ends, come back; the namespace's fd.

    The pair is made from the host with its peer born in the namespace: moving a link between namespaces
    waits for an RCU grace period under the rtnl lock, which every create's namespace work also needs."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    netns = -1
    inside = None
    try:
        kernel.unshare(kernel.CLONE_NEWNET)          # this thread only
        try:
            netns = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            for name, value in SANDBOX_SYSCTLS:      # /proc/sys/net is the opener's namespace's
                with open(f"/proc/sys/{name}", "w") as f:
                    f.write(value)
            # pyroute2 opens its socket on first use: this one is used while this thread is inside, so it
            # stays the namespace's after the thread leaves
            inside = IPRoute()
            inside.link("set", index=inside.link_lookup(ifname="lo")[0], state="up")
        finally:
            kernel.setns(own, kernel.CLONE_NEWNET)   # back home; it cannot fail with our own fd
        with IPRoute() as ipr:
            ipr.link("add", ifname=end.ifname, kind="veth", peer={"ifname": "eth0", "net_ns_fd": netns})
            idx = ipr.link_lookup(ifname=end.ifname)[0]
            with open(f"/proc/sys/net/ipv6/conf/{end.ifname}/disable_ipv6", "w") as f:
                f.write("1")
            ipr.addr("add", index=idx, address=end.gateway, prefixlen=30)
            ipr.link("set", index=idx, state="up")
        eth0 = inside.link_lookup(ifname="eth0")[0]
        inside.addr("add", index=eth0, address=end.address, prefixlen=30)
        inside.link("set", index=eth0, state="up")
        inside.route("add", gateway=end.gateway)
        return netns
    except BaseException:
        if netns >= 0:
            os.close(netns)
        raise
    finally:
        if inside is not None:
            inside.close()
        os.close(own)


TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
TAP, BRIDGE = "tap0", "br0"


def tap(end: End) -> int:
    """The end made a VM's: in its namespace a tap (its fd, for QEMU: the tap lives while an fd of it is open)
    and a bridge of the tap and eth0, whose address goes to the guest behind the tap (the namespace keeps
    none). The host sees the guest's frames on the veth as a container's packets: the same rules, the same
    shaping (eth0's egress, in the namespace), the same reverse-path check. Blocking: Aether's thread."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    fd = -1
    try:
        kernel.setns(end.netns, kernel.CLONE_NEWNET)
        try:
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", TAP.encode(), IFF_TAP | IFF_NO_PI))
            with IPRoute() as ipr:
                eth0, tap_i = ipr.link_lookup(ifname="eth0")[0], ipr.link_lookup(ifname=TAP)[0]
                ipr.addr("del", index=eth0, address=end.address, prefixlen=30)   # its route goes with it
                ipr.link("add", ifname=BRIDGE, kind="bridge", br_stp_state=0, br_forward_delay=0)
                bridge = ipr.link_lookup(ifname=BRIDGE)[0]
                ipr.link("set", index=eth0, master=bridge)
                ipr.link("set", index=tap_i, master=bridge, state="up")
                ipr.link("set", index=bridge, state="up")
        finally:
            kernel.setns(own, kernel.CLONE_NEWNET)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    finally:
        os.close(own)
    return fd


MAX_RATE = (1 << 32) - 1           # htb's rate field (bytes/s); a policy above it is not shaped further


def shape(end: End, rate: int, local_ports: tuple[int, ...] = ()) -> None:
    """Shape both directions of a sandbox's link to rate bytes/s: HTB on the host end (what the sandbox
    receives) and on its own end (what it sends; it cannot change it: no CAP_NET_ADMIN there). Traffic with
    the node's own services on local_ports of its gateway (the package mirrors) is not shaped: a class of its
    own, chosen by address and port, so nothing else the sandbox sends or receives can ride it."""
    rate = min(rate, MAX_RATE)
    burst = max(rate // 20, 64 << 10)          # 50 ms of it, at least 64 KiB
    gw = int(ipaddress.IPv4Address(end.gateway))

    def apply(ipr: IPRoute, name: str, keys: list[list[str]]) -> None:
        idx = ipr.link_lookup(ifname=name)[0]
        try:
            ipr.tc("add", "htb", idx, 0x10000, default=0x10)
        except NetlinkError as exc:
            if exc.code != errno.EEXIST:
                raise                           # shaped before: only the rate changes
            ipr.tc("change-class", "htb", idx, 0x10010, parent=0x10000, rate=rate, ceil=rate, burst=burst)
            return
        ipr.tc("add-class", "htb", idx, 0x10010, parent=0x10000, rate=rate, ceil=rate, burst=burst)
        if keys:
            ipr.tc("add-class", "htb", idx, 0x10020, parent=0x10000, rate=MAX_RATE, ceil=MAX_RATE, burst=1 << 20)
        for key in keys:
            ipr.tc("add-filter", "u32", idx, parent=0x10000, prio=1, protocol=0x0800, target=0x10020, keys=key)

    # u32 keys: value/mask+offset in the IPv4 header (no options: 20 bytes, then the TCP ports)
    with IPRoute() as ipr:                      # to the sandbox: from the gateway's local_port
        apply(ipr, end.ifname, [[f"0x{gw:08x}/0xffffffff+12", f"0x{port << 16:08x}/0xffff0000+20"]
                                for port in local_ports])
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        kernel.setns(end.netns, kernel.CLONE_NEWNET)
        try:
            with IPRoute() as ipr:              # from the sandbox: to the gateway's local_port
                apply(ipr, "eth0", [[f"0x{gw:08x}/0xffffffff+16", f"0x{port:08x}/0x0000ffff+20"]
                                    for port in local_ports])
        finally:
            kernel.setns(own, kernel.CLONE_NEWNET)
    finally:
        os.close(own)
