"""The Aether proxy's connection handling: every TCP connection of a sandbox arrives here (redirected by
the node's rules, or sent to it as HTTP(S)_PROXY) and is decided before a byte goes upstream.

- Explicit proxy (the connection was to the proxy itself): `CONNECT host:port` or an absolute-form
  request (`GET http://host/...`). Transparent (anything else): the original destination (SO_ORIGINAL_DST)
  and the first bytes say where it goes: a TLS ClientHello's server name, an HTTP request's Host, else the
  address itself.
- A name must be allowed on that port; the proxy resolves it itself (dns.Pins: the addresses Aether's DNS
  answered) and connects only to those, never to the address the sandbox used. TLS's server name must be
  the CONNECT host; HTTP's Host must be the URL's and the connection's name, on every request of the
  connection (requests are read one by one: a second one to another host is refused); a CONNECT inside a
  connection (a chained proxy) is refused.
- An address (no name) must be in an allowed range on that port.
- Every address connected to passes the node's guard (policy.Guard): no host, sandbox, private or
  link-local address unless the operator allowed its range. So an allowed name that resolves to a private
  address (DNS rebinding) is refused.
- A sandbox has at most max_connections open at once.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import logging
import resource
import socket
import struct
import time

from aether import relay, sniff
from aether.dns import DnsError, Pins
from aether.mirrorplaces import MirrorPlaces, less
from aether.policy import Decision, Guard, SandboxState

SO_ORIGINAL_DST = 80
FIRST_BYTES = 10.0          # seconds a connection has to send its first bytes (TLS or HTTP, or raw)
RAW_WAIT = 0.5              # transparent: a client that says nothing this long is a server-speaks-first one
CONNECT_TIMEOUT = 10.0
MIRROR_WAIT = 60.0          # seconds a connection past those waits for a place before it is refused (uv opens ~50)
MAX_HELLO = (16 << 10) + 5
log = logging.getLogger("aether.proxy")


class Denied(Exception):
    """A connection the policy refuses (the message is the reason)."""


def original_dst(sock: socket.socket) -> tuple[str, int]:
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, addr = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(addr), port


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


class Connection:
    """One sandbox connection, from its first byte to its close."""

    def __init__(self, proxy: "Proxy", sock: socket.socket, sb: SandboxState, peer: str) -> None:
        self.proxy, self.sock, self.sb, self.peer = proxy, sock, sb, peer
        self.buf = b""
        self.name, self.address, self.port = "", "", 0
        self.counted = [0, 0]     # bytes out (to upstream), in
        self.explicit = False
        self.http = False         # decided by an HTTP request: the next ones are read and checked too
        self.host = ""            # what every request of such a connection must name (its Host)
        self.decided = False      # allowed, and connected upstream (or connecting)
        self.mirror = False       # to the node's package mirror (any sandbox with a network may)
        self.cut_why = ""         # why the proxy ended it (the sandbox ended, its policy changed)
        self.task: asyncio.Task | None = None
        self.upstream: socket.socket | None = None

    def cut(self, why: str) -> None:
        """End this connection now, whatever it waits on (its upstream may never close it): its task is
        cancelled and its sockets shut, so it ends even where a cancel is lost (wait_for may swallow one
        whose inner future finished in the same pass)."""
        if self.task is None or self.task.done():
            return
        self.cut_why = self.cut_why or why
        self.task.cancel()
        for s in (self.sock, self.upstream):
            if s is not None:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def still_allowed(self) -> bool:
        """Whether the sandbox's policy (as it is now) allows what this connection was allowed to reach."""
        if self.mirror:
            return self.sb.policy.mode != "none"
        if self.name:
            return self.sb.name_allowed(self.name, self.port)
        try:
            return self.sb.address_allowed(ipaddress.ip_address(self.address), self.port)
        except ValueError:
            return False

    async def _more(self, timeout: float) -> bool:
        data = await asyncio.wait_for(relay.recv(self.sock), timeout)
        self.buf += data
        return bool(data)

    async def _head(self) -> sniff.Request:
        while (req := sniff.request_head(self.buf)) is None:
            if len(self.buf) > sniff.MAX_HEAD or b"\r\n\r\n" in self.buf:
                raise Denied("a malformed HTTP request")
            if not await self._more(FIRST_BYTES):
                raise Denied("closed before its request")
        return req

    async def _hello(self) -> str | None:
        while len(self.buf) < max(5, sniff.tls_record_length(self.buf)):
            if len(self.buf) > MAX_HELLO or not await self._more(FIRST_BYTES):
                raise Denied("a truncated TLS ClientHello")
        return sniff.client_hello_sni(self.buf)

    async def run(self) -> None:
        self.task = asyncio.current_task()
        self.sb.live.add(self)
        upstream = None
        counted = mirrored = False
        try:
            dst, dport = original_dst(self.sock)
            self.address, self.port = dst, dport
            if self.sb.open >= min(self.sb.max_connections, self.proxy.share):
                raise Denied(f"the sandbox has {self.sb.open} connections open (its limit)")
            if self.proxy.tenant_open[self.sb.owner] >= 3 * self.proxy.share:
                raise Denied(f"its tenant's sandboxes have {3 * self.proxy.share} connections open on this node (the "
                             "most one tenant may: a quarter stays for the others)")
            self.sb.open += 1            # from its accept: one being decided counts too
            self.proxy.tenant_open[self.sb.owner] += 1
            counted = True
            self.explicit = dport == self.proxy.port and dst == self.proxy.gateway_of(self.peer)
            if self.explicit:        # the destination is the request's, not the proxy
                self.address, self.port = "", 0
            target = await (self._explicit() if self.explicit else self._transparent(dst, dport))
            self.decided = True   # from here a policy change cuts it (close_revoked); one made while it was
            if not self.still_allowed():   # being decided (a CONNECT waiting for its first bytes) is seen here
                raise Denied("no longer in the allow list")
            if self.mirror:      # the node's mirrors serve every tenant: 250 slow connections of one sandbox left
                await self._mirror_place()   # apt-cacher-ng answering no one (helper A3)
                mirrored = True
            upstream = self.upstream = await self._connect(target)
            await self._relay(upstream)
            self.proxy.note(self.sb, Decision(time.time(), "allowed", self.name, self.address, self.port,
                                              bytes_out=self.counted[0], bytes_in=self.counted[1]))
        except Denied as exc:
            self.proxy.note(self.sb, Decision(time.time(), "denied", self.name, self.address, self.port,
                                              reason=str(exc)))
            if self.explicit or sniff.looks_http(self.buf):
                await self._say("403 Forbidden", f"aether: {exc}")
            else:                # a reset, as a refused connection reads to the client
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except (asyncio.TimeoutError, ConnectionError, OSError) as exc:
            self.proxy.note(self.sb, Decision(time.time(), "failed", self.name, self.address, self.port,
                                              reason=str(exc) or type(exc).__name__))
            if self.explicit and upstream is None:
                await self._say("502 Bad Gateway", f"aether: {exc or type(exc).__name__}")
        except asyncio.CancelledError:
            if not self.cut_why:
                raise              # the proxy stopping
            self.proxy.note(self.sb, Decision(time.time(), "denied" if self.decided else "failed", self.name,
                                              self.address, self.port, reason=f"closed: {self.cut_why}",
                                              bytes_out=self.counted[0], bytes_in=self.counted[1]))
        except Exception as exc:   # a parser's slip: recorded and closed, never a connection off the record
            log.exception("connection of %s", self.sb.sandbox)
            self.proxy.note(self.sb, Decision(time.time(), "failed", self.name, self.address, self.port,
                                              reason=f"the proxy failed on it ({type(exc).__name__})"))
        finally:
            self.sb.live.discard(self)
            if counted:
                self.sb.open -= 1
                less(self.proxy.tenant_open, self.sb.owner)
            if mirrored:
                self.proxy.mirrors_held.give(self.sb)
            for s in (self.sock, upstream):
                if s is not None:
                    s.close()

    async def _mirror_place(self) -> None:
        """Take a place among the sandbox's and its tenant's connections to the node's mirrors, or wait up to
        MIRROR_WAIT, in turn, for one to be handed over (refused at once, the 17th of uv's ~50 parallel
        downloads failed its install)."""
        sb, places = self.sb, self.proxy.mirrors_held
        if places.room(sb) and not sb.mirror_waiting:
            places.take(sb)
            return
        handed = asyncio.get_running_loop().create_future()
        places.queue(sb, handed)
        try:
            await asyncio.wait_for(asyncio.shield(handed), MIRROR_WAIT)
        except asyncio.TimeoutError:
            if handed.done():   # (handed over as the wait ended)
                return
            places.unqueue(sb, handed)
            raise Denied(f"{places.full(sb)} connections to the node's mirrors open (the most it may) for "
                         f"{MIRROR_WAIT:.0f}s") from None
        except asyncio.CancelledError:
            if handed.done():
                places.give(sb)
            else:
                places.unqueue(sb, handed)
            raise
        if self.sock is not None and _closed(self.sock):   # its client gave up waiting (pip's 15 s, uv's 30 s):
            places.give(sb)                                 # the place goes on, no connection to the mirror
            raise ConnectionError("the sandbox closed it while it waited for a place at the node's mirrors")

    async def _say(self, status: str, text: str) -> None:
        body = (text + "\n").encode()
        try:
            await asyncio.wait_for(relay.sendall(self.sock, f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n"
                                                 f"Connection: close\r\n\r\n".encode() + body), 2.0)
        except (OSError, asyncio.TimeoutError):
            pass

    # ---- deciding --------------------------------------------------------------------------------------

    async def _explicit(self) -> tuple[str, int]:
        req = await self._head()
        if req.method == "CONNECT":
            host, port = sniff.split_host(req.target)
            if port <= 0 or not host:
                raise Denied(f"CONNECT needs host:port, got {req.target!r}")
            self.name, self.port = ("" if _is_address(host) else host), port
            self.buf = self.buf[req.size:]
            target = await self._check(host, port)
            await relay.sendall(self.sock, b"HTTP/1.1 200 Connection established\r\n\r\n")
            await self._inner(host)
            return target
        absolute = sniff.absolute_http(req.target)
        if absolute is None:
            raise Denied(f"a proxy request is CONNECT host:port or GET http://host/..., got {req.target[:80]!r}")
        host, port = sniff.split_host(absolute[0], 80)
        self.name, self.port = ("" if _is_address(host) else host), port
        return await self._check(host, port, http=True)

    async def _inner(self, host: str) -> None:
        """The first bytes inside a CONNECT tunnel: TLS to that very name, or HTTP to it."""
        if not self.buf and not await self._more(FIRST_BYTES):
            raise Denied("closed before a byte went through its tunnel")
        if sniff.looks_tls(self.buf):
            sni = await self._hello()
            if self.name and sni != self.name:
                raise Denied(f"TLS server name {sni!r} is not the CONNECT host {self.name!r}")
        elif sniff.looks_http(self.buf):
            self._check_request(await self._head(), host)
            self.http = True
        elif self.name:
            raise Denied(f"a tunnel to {self.name} carries neither TLS nor HTTP")

    async def _transparent(self, dst: str, dport: int) -> tuple[str, int]:
        mirror = self._mirror(dst, dport)
        if mirror is not None:       # straight to the node's mirror: it alone reads the requests (apt's name the
            return mirror            # archive, as to a proxy: the mirror's to serve or refuse)
        try:
            await self._more(RAW_WAIT)
        except asyncio.TimeoutError:
            pass
        if sniff.looks_tls(self.buf):
            sni = await self._hello()
            if sni:
                self.name = sni
                return await self._check(sni, dport)
        elif sniff.looks_http(self.buf):
            req = await self._head()
            if req.method == "CONNECT":
                raise Denied("a CONNECT through another proxy")
            if req.host is None:
                raise Denied("an HTTP request without one Host header")
            self.name = "" if _is_address(req.host) else req.host
            return await self._check(req.host, dport, http=True)
        return await self._check(dst, dport)

    async def _check(self, host: str, port: int, http: bool = False) -> tuple[str, int]:
        """The address to connect to for host:port, or Denied."""
        sb, guard = self.sb, self.proxy.guard
        self.host = host
        mirror = self._mirror(host, port)
        if mirror is not None:       # the node's package mirror asked through the proxy (HTTP_PROXY)
            if http:
                self._check_request(sniff.request_head(self.buf), host)
                self.http = True
            return mirror
        if _is_address(host):
            address = ipaddress.ip_address(host)
            self.address = host
            if not sb.address_allowed(address, port):
                raise Denied(f"{host}:{port} is not in the allow list")
            if why := guard.denied(address):
                raise Denied(f"{host} is {why}")
            target = (host, port)
        else:
            if not sb.name_allowed(host, port):
                raise Denied(f"{host}:{port} is not in the allow list")
            try:
                addresses = await self.proxy.pins.resolve(host)
            except DnsError as exc:
                raise Denied(f"{host} does not resolve: {exc}") from None
            good = [a for a in addresses if not guard.denied(ipaddress.ip_address(a))]
            if not good:
                why = guard.denied(ipaddress.ip_address(addresses[0])) if addresses else "no address"
                raise Denied(f"{host} resolves to {addresses[0] if addresses else 'nothing'}: {why}")
            self.address = good[0]
            target = (good[0], port)
        if http:
            self._check_request(sniff.request_head(self.buf), host)
            self.http = True
        return target

    def _mirror(self, host: str, port: int) -> tuple[str, int] | None:
        """The node's package mirror behind host:port when that is the sandbox's gateway and a mirror's port
        (any sandbox with a network may use them), named so in its decision; else None."""
        mirror = self.proxy.mirrors.get(port) if host == self.proxy.gateway_of(self.peer) else None
        if mirror is not None:
            self.name, self.address, self.mirror = f"mirror:{port}", mirror[0], True
        return mirror

    def _check_request(self, req: sniff.Request | None, host: str) -> None:
        if req is None:
            raise Denied("a malformed HTTP request")
        if req.method == "CONNECT":
            raise Denied("a CONNECT through another proxy")
        if not req.target.startswith("/") and req.target != "*":   # absolute form: http, to that very host
            absolute = sniff.absolute_http(req.target)
            if absolute is None or sniff.split_host(absolute[0])[0] != host:
                raise Denied(f"a request for {req.target[:80]!r} on a connection to {host}")
        if req.host != host:
            raise Denied(f"Host {req.host!r} on a connection to {host}")
        if req.length == -1:
            raise Denied("a chunked or ambiguous request body (give Content-Length)")

    # ---- relaying --------------------------------------------------------------------------------------

    async def _connect(self, target: tuple[str, int]) -> socket.socket:
        up = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        up.setblocking(False)
        up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # a relay adds no Nagle wait of its own
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(up, target), CONNECT_TIMEOUT)
        except BaseException:
            up.close()
            raise
        return up

    async def _relay(self, up: socket.socket) -> None:
        back = asyncio.ensure_future(relay.pump(up, self.sock, self.counted, 1))
        try:
            if self.http:
                await self._requests(up)
            else:
                if self.buf:
                    await relay.sendall(up, self.buf)
                    self.counted[0] += len(self.buf)
                await relay.pump(self.sock, up, self.counted, 0)
            await back
        finally:
            back.cancel()   # and gone before the sockets close: its fd's reader is removed a pass later, when the
            await asyncio.gather(back, return_exceptions=True)   # number may be another connection's

    async def _requests(self, up: socket.socket) -> None:
        """Client -> upstream, one request at a time, each checked (its Host, no CONNECT), its body passed
        by its Content-Length; an absolute-form target is sent in origin form."""
        host = self.host or self.name or self.address
        while True:
            if not self.buf:
                try:
                    if not await self._more(3600.0):
                        break
                except asyncio.TimeoutError:
                    break
            req = await self._head()
            try:
                self._check_request(req, host)
            except Denied as exc:
                self.proxy.note(self.sb, Decision(time.time(), "denied", self.name, self.address, self.port,
                                                  reason=str(exc)))
                raise ConnectionError(str(exc)) from None
            head = self.buf[:req.size]
            absolute = sniff.absolute_http(req.target)
            if absolute is not None:
                head = f"{req.method} {absolute[1]} {req.version}".encode("latin-1") + head[head.index(b"\r\n"):]
            body, self.buf = req.length or 0, self.buf[req.size:]
            await relay.sendall(up, head)
            self.counted[0] += len(head)
            while body:
                if not self.buf and not await self._more(3600.0):
                    raise ConnectionError("the sandbox closed its connection in a request's body")
                part, self.buf = self.buf[:body], self.buf[body:]
                await relay.sendall(up, part)
                self.counted[0] += len(part)
                body -= len(part)
        try:
            up.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _closed(sock: socket.socket) -> bool:
    """Whether the peer closed sock (nothing left to read but its end)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


class Proxy:
    """The node's proxy state: sandboxes by address, the guard, the pins, where decisions go."""

    def __init__(self, guard: Guard, pins: Pins, port: int, mirrors: dict[int, tuple[str, int]] | None = None) -> None:
        self.guard, self.pins, self.port = guard, pins, port
        self.mirrors = mirrors or {}     # gateway port -> the node's mirror behind it
        self.sandboxes: dict[str, SandboxState] = {}
        self._reporting: set[SandboxState] = set()
        self._tasks: set[asyncio.Task] = set()
        self.tenant_open: collections.Counter[str] = collections.Counter()   # connections open, by owner
        self.mirrors_held = MirrorPlaces()   # connections to the node's mirrors, by sandbox and owner, and waiters

    @property
    def share(self) -> int:
        """The most one sandbox holds at once, whatever its policy says: a quarter of what this process's fds
        relay (6 a connection), so one sandbox never takes the node's proxy away from the others. One tenant's
        sandboxes together hold at most three of those quarters (five sandboxes of one tenant took every fd: no
        other tenant's sandbox connected, and DNS failed: helper A3)."""
        return max(64, (resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 256) // 6 // 4)

    def track(self, task: asyncio.Task) -> None:
        """Hold a connection's task until it ends."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    def gateway_of(peer: str) -> str:
        return str(ipaddress.IPv4Address(int(ipaddress.IPv4Address(peer)) - 1))

    def note(self, sb: SandboxState, decision: Decision) -> None:
        sb.note(decision)
        self._reporting.add(sb)

    def flush(self) -> list[dict]:
        out = [r for sb in self._reporting if (r := sb.take()) is not None]
        self._reporting.clear()
        return out

    async def accept(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            peer = sock.getpeername()[0]
        except OSError:
            sock.close()
            return
        sb = self.sandboxes.get(peer)
        if sb is None:           # not a sandbox of this node (or one just gone): nothing to decide with
            sock.close()
            return
        await Connection(self, sock, sb, peer).run()
