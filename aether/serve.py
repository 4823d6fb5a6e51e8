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
import ipaddress
import os
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


class Dns(asyncio.DatagramProtocol):
    """Aether's resolver: allowed names get their (pinned, guarded) addresses, anything else NXDOMAIN."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        sb = self.proxy.sandboxes.get(addr[0])
        q = dns.parse_query(data) if sb is not None else None
        if q is not None:
            asyncio.ensure_future(self._answer(sb, q, addr))

    async def _answer(self, sb: SandboxState, q: dns.Question, addr) -> None:
        if not sb.name_allowed(q.name, None):
            self.proxy.note(sb, Decision(time.time(), "denied", q.name, "", 53, reason="a DNS query for a name "
                                         "not in the allow list"))
            reply = dns.answer(q, dns.NXDOMAIN)
        elif q.qtype != dns.A:
            reply = dns.answer(q, dns.NOERROR)          # no AAAA (no IPv6), nothing else
        else:
            try:
                addresses = await self.proxy.pins.resolve(q.name)
            except dns.DnsError:
                reply = dns.answer(q, dns.SERVFAIL)
            else:
                good = [a for a in addresses if not self.proxy.guard.denied(ipaddress.ip_address(a))]
                if addresses and not good:
                    self.proxy.note(sb, Decision(time.time(), "denied", q.name, addresses[0], 53,
                                                 reason="resolves to " + self.proxy.guard.denied(
                                                     ipaddress.ip_address(addresses[0]))))
                reply = (dns.answer(q, dns.NOERROR, good, self.proxy.pins.ttl(q.name)) if good
                         else dns.answer(q, dns.NXDOMAIN))
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
            self.proxy.sandboxes.pop(address, None)
            return
        if msg["op"] != "set":
            raise ValueError(f"unknown op {msg['op']!r}")
        policy = check(msgspec.convert(msg["policy"], Network))
        sb = self.proxy.sandboxes.get(address)
        if sb is not None and sb.sandbox == msg["sandbox"]:
            sb.update(policy)
        else:
            self.proxy.sandboxes[address] = SandboxState.of(msg["sandbox"], policy)


async def _accept_loop(proxy: Proxy, listener: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    while True:
        conn, _ = await loop.sock_accept(listener)
        asyncio.ensure_future(proxy.accept(conn))


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
    try:
        await control.serve()              # the edge went away: so do we
    finally:
        for t in tasks:
            t.cancel()


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
    try:
        asyncio.run(main_async(args))
    except (ConnectionError, OSError) as exc:
        os.write(2, f"aether: {exc}\n".encode())
        raise SystemExit(1)


if __name__ == "__main__":
    main()
