"""DNS for Aether: just enough of the wire format to read a query's question, answer it with A records or
NXDOMAIN, and ask the upstream resolver (`--aether-dns`) for a name's A records and their TTL."""
from __future__ import annotations

import asyncio
import random
import re
import socket
import struct
import time
from typing import NamedTuple

A, AAAA = 1, 28
IN = 1                             # the Internet class (CH, HS, ANY: no address)
NOERROR, SERVFAIL, NXDOMAIN, REFUSED = 0, 2, 3, 5
MIN_TTL, MAX_TTL = 5, 300          # seconds a resolution is pinned, whatever the upstream said
QUERY_TIMEOUT = 2.0


class DnsError(Exception):
    """The upstream resolver did not answer, or answered with an error."""


class Question(NamedTuple):
    id: int
    name: str                      # lower-case, no trailing dot
    qtype: int
    qclass: int
    raw: bytes                     # the question section as sent (echoed in the answer)
    rd: bool


def _read_name(data: bytes, pos: int, depth: int = 0) -> tuple[str, int]:
    labels = []
    while True:
        size = data[pos]
        if size & 0xC0 == 0xC0:                       # compression pointer
            if depth > 8:
                raise ValueError("pointer loop")
            target = struct.unpack(">H", data[pos:pos + 2])[0] & 0x3FFF
            rest, _ = _read_name(data, target, depth + 1)
            labels.append(rest)
            return ".".join(filter(None, labels)), pos + 2
        pos += 1
        if size == 0:
            return ".".join(labels), pos
        if size > 63:
            raise ValueError("label too long")
        labels.append(data[pos:pos + size].decode("ascii"))
        pos += size


def parse_query(data: bytes) -> Question | None:
    """The one question of a standard query; None for anything else or malformed."""
    try:
        qid, flags, qd, an, ns, ar = struct.unpack(">6H", data[:12])
        if flags & 0x8000 or (flags >> 11) & 0xF != 0 or qd != 1:   # a response, not a QUERY, or not one question
            return None
        name, pos = _read_name(data, 12)
        qtype, qclass = struct.unpack(">HH", data[pos:pos + 4])
        if len(name) > 253:
            return None
        return Question(qid, name.lower().rstrip("."), qtype, qclass, data[12:pos + 4], bool(flags & 0x0100))
    except (struct.error, IndexError, ValueError, UnicodeDecodeError):
        return None


def answer(q: Question, rcode: int, addresses: list[str] = (), ttl: int = 0) -> bytes:
    """A response to q: rcode, and one A record per address (pointing at the question's name)."""
    flags = 0x8000 | 0x0080 | (0x0100 if q.rd else 0) | rcode      # response, recursion available
    out = [struct.pack(">6H", q.id, flags, 1, len(addresses), 0, 0), q.raw]
    for address in addresses:
        out.append(struct.pack(">HHHIH", 0xC00C, A, 1, ttl, 4) + socket.inet_aton(address))
    return b"".join(out)


_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")


def valid_name(name: str) -> bool:
    """A host name DNS can carry: ASCII labels of 1-63 letters, digits, '-' or '_', 253 bytes at most."""
    return 0 < len(name) <= 253 and name.isascii() and all(_LABEL.fullmatch(label) for label in name.split("."))


def _encode_name(name: str) -> bytes:
    return b"".join(bytes([len(label)]) + label.encode("ascii") for label in name.split(".") if label) + b"\0"


def _parse_a_records(data: bytes, qid: int) -> tuple[int, list[str], int]:
    """(rcode, A addresses of the answer, their smallest TTL) of a response to query qid."""
    rid, flags, qd, an, _, _ = struct.unpack(">6H", data[:12])
    if rid != qid or not flags & 0x8000:
        raise DnsError("a response to another query")
    pos = 12
    for _ in range(qd):
        _, pos = _read_name(data, pos)
        pos += 4
    addresses, ttl = [], MAX_TTL
    for _ in range(an):
        _, pos = _read_name(data, pos)
        rtype, _, rttl, size = struct.unpack(">HHIH", data[pos:pos + 10])
        pos += 10
        if rtype == A and size == 4:
            addresses.append(socket.inet_ntoa(data[pos:pos + 4]))
            ttl = min(ttl, rttl)
        pos += size
    return flags & 0xF, addresses, ttl


class _Once(asyncio.DatagramProtocol):
    def __init__(self, done: asyncio.Future) -> None:
        self.done = done

    def datagram_received(self, data: bytes, addr) -> None:
        if not self.done.done():
            self.done.set_result(data)

    def error_received(self, exc: Exception) -> None:
        if not self.done.done():
            self.done.set_exception(DnsError(str(exc)))


async def query_a(server: tuple[str, int], name: str) -> tuple[list[str], int]:
    """Ask server for name's A records: (addresses, ttl); [] for NXDOMAIN or no records; DnsError when
    the server fails or does not answer in time."""
    loop = asyncio.get_running_loop()
    qid = random.getrandbits(16)
    msg = struct.pack(">6H", qid, 0x0100, 1, 0, 0, 0) + _encode_name(name) + struct.pack(">HH", A, 1)
    done = loop.create_future()
    transport, _ = await loop.create_datagram_endpoint(lambda: _Once(done), remote_addr=server)
    try:
        transport.sendto(msg)
        try:
            data = await asyncio.wait_for(done, QUERY_TIMEOUT)
        except asyncio.TimeoutError:
            raise DnsError(f"resolver {server[0]}:{server[1]} did not answer for {name}") from None
    finally:
        transport.close()
    try:
        rcode, addresses, ttl = _parse_a_records(data, qid)
    except (struct.error, IndexError, ValueError, UnicodeDecodeError) as exc:
        raise DnsError(f"malformed answer for {name}: {exc}") from None
    if rcode == NXDOMAIN:
        return [], MIN_TTL
    if rcode != NOERROR:
        raise DnsError(f"resolver answered rcode {rcode} for {name}")
    return addresses, max(MIN_TTL, min(MAX_TTL, ttl))


class Pins:
    """Names resolved through the upstream, each pinned for its TTL: what Aether's DNS answers a sandbox
    and the only addresses its proxy connects that name to."""

    def __init__(self, server: tuple[str, int] | None) -> None:
        self.server = server
        self._cache: dict[str, tuple[float, list[str]]] = {}
        self._inflight: dict[str, asyncio.Future] = {}

    async def resolve(self, name: str) -> list[str]:
        """name's addresses (pinned); DnsError when it cannot be resolved now (or is no host name)."""
        if not valid_name(name):
            raise DnsError("not a valid host name")
        hit = self._cache.get(name)
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        if self.server is None:
            raise DnsError("this node has no upstream resolver (dsec edge --aether-dns)")
        fut = self._inflight.get(name)
        if fut is None:
            fut = self._inflight[name] = asyncio.ensure_future(query_a(self.server, name))
            fut.add_done_callback(lambda _f: self._inflight.pop(name, None))
        addresses, ttl = await asyncio.shield(fut)
        self._cache[name] = (time.monotonic() + ttl, addresses)
        if len(self._cache) > 100_000:
            self._cache.pop(next(iter(self._cache)))
        return addresses

    def ttl(self, name: str) -> int:
        hit = self._cache.get(name)
        return max(0, int(hit[0] - time.monotonic())) if hit else 0
