"""The Aether proxy process of one node: `python -m aether.serve --control-fd N ...`, started and supervised
by the edge (aether/node.py), never in the edge's event loop, so a flood through it cannot delay execs.

It serves the proxy (proxy.py) on one TCP port and Aether's DNS on one UDP port, both on every sandbox
gateway of the node (the node's rules redirect sandboxes' TCP and DNS to them). The edge speaks to it over
the control socket, JSON lines:

    edge -> proxy  {"op": "set", "seq": N, "address": A, "sandbox": ID, "policy": {...}}   in force once answered
                   {"op": "drop", "seq": N, "address": A}
    proxy -> edge  {"hello": {"port": P, "dns_port": D}}                                    once, when serving
                   {"seq": N} or {"seq": N, "error": "..."}                                 the answer to an op
                   {"report": [{"sandbox": ID, "decisions": [...], "suppressed": {...}}]}   at most once a second
"""
from __future__ import annotations

import argparse
import asyncio
import errno
import ipaddress
import logging
import os
import resource
import signal
import socket
import time

import msgspec

from aether import dns
from aether.policy import Decision, Guard, SandboxState
from aether.proxy import Proxy
from bus.errors import InvalidRequest
from bus.network import Network, check

REPORT_EVERY = 1.0
BACKLOG = 4096
LOOKUPS_PER_SANDBOX = 32   # a sandbox's DNS questions waiting on the upstream at once (more: SERVFAIL)
ACCEPT_PAUSE = 0.05     # seconds the accept loop waits when out of fds
NOFILE = 1 << 20        # the proxy's open-file limit (6 fds a relayed connection; bounded by memory: see
                        # edge/backends/hosttables.lift_host_tables)
log = logging.getLogger("aether.serve")


class Dns(asyncio.DatagramProtocol):
    """Aether's resolver: allowed names get their (pinned, guarded) addresses, anything else NXDOMAIN."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        sb = self.proxy.sandboxes.get(addr[0])
        if sb is None or not sb.query_allowed(time.monotonic()):   # past its rate: dropped unread (it asks again)
            return
        q = dns.parse_query(data)
        if q is not None:
            asyncio.ensure_future(self._answer(sb, q, addr))

    async def _answer(self, sb: SandboxState, q: dns.Question, addr) -> None:
        if not dns.valid_name(q.name):
            self.proxy.note(sb, Decision(time.time(), "denied", q.name[:253], "", 53, reason="a DNS query for "
                                         "no valid host name"))
            reply = dns.answer(q, dns.NXDOMAIN)
        elif not sb.name_allowed(q.name, None):
            self.proxy.note(sb, Decision(time.time(), "denied", q.name, "", 53, reason="a DNS query for a name "
                                         "not in the allow list"))
            reply = dns.answer(q, dns.NXDOMAIN)
        elif q.qtype != dns.A or q.qclass != dns.IN:
            reply = dns.answer(q, dns.NOERROR)          # no AAAA (no IPv6), nothing else (a CH question got an A)
        elif sb.lookups >= LOOKUPS_PER_SANDBOX:     # its own flood waits on itself, not on the node
            reply = dns.answer(q, dns.SERVFAIL)
        else:
            sb.lookups += 1
            try:
                addresses = await self.proxy.pins.resolve(q.name)
            except (dns.DnsError, OSError):    # (OSError: out of fds; the query is refused, the loop goes on)
                reply = dns.answer(q, dns.SERVFAIL)
            else:
                good = [a for a in addresses if not self.proxy.guard.denied(ipaddress.ip_address(a))]
                if addresses and not good:
                    self.proxy.note(sb, Decision(time.time(), "denied", q.name, addresses[0], 53,
                                                 reason="resolves to " + self.proxy.guard.denied(
                                                     ipaddress.ip_address(addresses[0]))))
                reply = (dns.answer(q, dns.NOERROR, good, self.proxy.pins.ttl(q.name)) if good
                         else dns.answer(q, dns.NXDOMAIN))
            finally:
                sb.lookups -= 1
        if self.transport is not None:
            self.transport.sendto(reply, addr)


class Control:
    """The edge's side of the conversation (one stream socket)."""

    def __init__(self, proxy: Proxy, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.proxy = proxy
        self.reader, self.writer = reader, writer
        self.decoder = msgspec.json.Decoder()

    async def send(self, msg: dict) -> None:
        self.writer.write(msgspec.json.encode(msg) + b"\n")
        await self.writer.drain()

    async def serve(self) -> None:
        while line := await self.reader.readline():
            reply: dict = {}
            try:
                msg = self.decoder.decode(line)
                reply["seq"] = msg.get("seq", 0)
                self.apply(msg)
            except (InvalidRequest, ValueError, KeyError, TypeError, AttributeError, msgspec.DecodeError,
                    msgspec.ValidationError) as exc:
                reply["error"] = str(exc)
            await self.send(reply)

    def apply(self, msg: dict) -> None:
        address = str(ipaddress.IPv4Address(msg["address"]))
        if msg["op"] == "drop":
            gone = self.proxy.sandboxes.pop(address, None)
            if gone is not None:
                gone.close_all()       # its connections end with it (an upstream may never close one)
            return
        if msg["op"] != "set":
            raise ValueError(f"unknown op {msg['op']!r}")
        policy = check(msgspec.convert(msg["policy"], Network))
        sb = self.proxy.sandboxes.get(address)
        if sb is not None and sb.sandbox == msg["sandbox"]:
            sb.update(policy)
            sb.close_revoked()         # a connection the new list no longer allows ends now
        else:
            if sb is not None:
                sb.close_all()
            self.proxy.sandboxes[address] = SandboxState.of(msg["sandbox"], policy, str(msg.get("tenant", "")))


async def _accept_loop(proxy: Proxy, listener: socket.socket) -> None:
    """Accept for ever. Out of fds (or memory), the connection waits in the backlog while the loop pauses:
    before, the first EMFILE ended this task, silently, and no sandbox of the node connected again."""
    loop = asyncio.get_running_loop()
    short = 0.0
    while True:
        try:
            conn, _ = await loop.sock_accept(listener)
        except OSError as exc:
            if exc.errno in (errno.ECONNABORTED, errno.EPERM, errno.EPROTO, errno.EINTR):
                continue        # that one connection went (aborted, refused by a rule): the next
            if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                raise           # the listener itself is broken: the process ends, the edge starts another
            if time.monotonic() - short > 10:
                log.error("the proxy is out of %s: connections wait in its backlog", os.strerror(exc.errno))
                short = time.monotonic()
            await asyncio.sleep(ACCEPT_PAUSE)
            continue
        proxy.track(asyncio.ensure_future(proxy.accept(conn)))


async def _report_loop(proxy: Proxy, control: Control) -> None:
    while True:
        await asyncio.sleep(REPORT_EVERY)
        if report := proxy.flush():
            await control.send({"report": report})


def _listener(port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(BACKLOG)
    s.setblocking(False)
    return s


async def main_async(args: argparse.Namespace) -> None:
    upstream = None
    if args.dns:
        host, _, port = args.dns.rpartition(":") if args.dns.count(":") == 1 else (args.dns, "", "53")
        upstream = (host, int(port or 53))
    listener = _listener(args.port)
    mirrors = {}
    for item in args.mirror:
        port, _, target = item.partition("=")
        host, _, tport = target.rpartition(":")
        mirrors[int(port)] = (host, int(tport))
    proxy = Proxy(Guard(args.allow_cidr, args.sandboxes), dns.Pins(upstream), listener.getsockname()[1], mirrors)
    loop = asyncio.get_running_loop()
    udp, _ = await loop.create_datagram_endpoint(lambda: Dns(proxy), local_addr=("0.0.0.0", args.dns_port),
                                                 reuse_port=False)
    reader, writer = await asyncio.open_unix_connection(sock=socket.socket(fileno=args.control_fd),
                                                        limit=1 << 20)
    control = Control(proxy, reader, writer)
    await control.send({"hello": {"port": proxy.port, "dns_port": udp.get_extra_info("sockname")[1]}})
    tasks = [asyncio.ensure_future(t) for t in (_accept_loop(proxy, listener), _report_loop(proxy, control))]
    serving = asyncio.ensure_future(control.serve())   # until the edge goes away: so do we
    try:
        await asyncio.wait([serving, *tasks], return_when=asyncio.FIRST_COMPLETED)
        if serving.done() and not serving.cancelled() and serving.exception() is not None:
            raise serving.exception()      # (the edge's conversation broke: said, exit 1, as before)
        for t in tasks:                    # a loop that ended ends the process: the edge starts another
            if t.done():
                raise RuntimeError(f"a proxy loop ended: {t.exception() if not t.cancelled() else 'cancelled'}")
    finally:
        for t in (serving, *tasks):
            t.cancel()


def _raise_nofile() -> None:
    """As many open files as this process may hold, up to NOFILE: the kernel's most (fs.nr_open) where it
    may raise its hard limit (CAP_SYS_RESOURCE), else its hard limit (20,000 for root on this host)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        with open("/proc/sys/fs/nr_open") as f:
            most = min(NOFILE, int(f.read()))
        resource.setrlimit(resource.RLIMIT_NOFILE, (most, most))
    except (OSError, ValueError):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, NOFILE), hard))
        except (OSError, ValueError) as exc:
            log.warning("the proxy keeps its open-file limit %d (%s)", soft, exc)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m aether.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--control-fd", type=int, required=True, help="the edge's control socket (inherited)")
    parser.add_argument("--port", type=int, default=0, help="proxy port (0: any free one)")
    parser.add_argument("--dns-port", type=int, default=0, help="DNS port (0: any free one)")
    parser.add_argument("--dns", default="", help="upstream resolver, ip[:port]")
    parser.add_argument("--allow-cidr", action="append", default=[], help="a private range sandboxes may reach")
    parser.add_argument("--sandboxes", default="", help="the node's sandbox subnet (never reachable)")
    parser.add_argument("--mirror", action="append", default=[], metavar="PORT=HOST:PORT",
                        help="a node mirror sandboxes reach at their gateway's PORT")
    parser.add_argument("--node", default="", help="the node (named on the command line for leftover checks)")
    args = parser.parse_args()
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # a terminal ^C is for the edge, which stops us
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    _raise_nofile()
    try:
        asyncio.run(main_async(args))
    except (ConnectionError, OSError) as exc:
        os.write(2, f"aether: {exc}\n".encode())
        raise SystemExit(1)


if __name__ == "__main__":
    main()
