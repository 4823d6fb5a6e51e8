"""What the first bytes of a connection say: a TLS ClientHello's server name (SNI), or an HTTP request's
head (method, target, Host). Parsers of untrusted bytes: they return None for anything malformed, never
raise, and never read past what they were given."""
from __future__ import annotations

import struct
from typing import NamedTuple

MAX_HEAD = 64 << 10          # an HTTP request head longer than this is refused
METHODS = (b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"CONNECT", b"TRACE")


def looks_tls(data: bytes) -> bool:
    """A TLS handshake record (a ClientHello starts one)."""
    return len(data) >= 3 and data[0] == 0x16 and data[1] == 3


def looks_http(data: bytes) -> bool:
    """An HTTP/1 request line's start."""
    return any(data.startswith(m + b" ") for m in METHODS)


def tls_record_length(data: bytes) -> int:
    """Bytes of the first TLS record (header included), 0 if not known yet."""
    return 5 + struct.unpack(">H", data[3:5])[0] if len(data) >= 5 else 0


def client_hello_sni(data: bytes) -> str | None:
    """The server name of a ClientHello (its first record); None when absent or malformed."""
    try:
        if not looks_tls(data) or len(data) < tls_record_length(data) or data[5] != 1:   # handshake: client_hello
            return None
        body = data[9:tls_record_length(data)]
        pos = 2 + 32                                  # version, random
        pos += 1 + body[pos]                          # session id
        pos += 2 + struct.unpack(">H", body[pos:pos + 2])[0]   # cipher suites
        pos += 1 + body[pos]                          # compression methods
        end = pos + 2 + struct.unpack(">H", body[pos:pos + 2])[0]
        pos += 2
        while pos + 4 <= end <= len(body):
            kind, size = struct.unpack(">HH", body[pos:pos + 4])
            pos += 4
            if kind == 0:                             # server_name: list of (type, name)
                names = body[pos:pos + size]
                npos = 2
                while npos + 3 <= len(names):
                    ntype, nlen = names[npos], struct.unpack(">H", names[npos + 1:npos + 3])[0]
                    name = names[npos + 3:npos + 3 + nlen]
                    if ntype == 0 and len(name) == nlen:
                        return name.decode("ascii").lower().rstrip(".")
                    npos += 3 + nlen
                return None
            pos += size
    except (IndexError, struct.error, UnicodeDecodeError):
        return None
    return None


class Request(NamedTuple):
    """An HTTP request head."""

    method: str
    target: str
    version: str
    host: str | None          # the Host header (lower-case, port stripped), None when absent or repeated
    headers: list[tuple[str, str]]
    length: int | None        # Content-Length, None when absent; -1 when chunked or malformed
    size: int                 # bytes of the head, the blank line included


def request_head(data: bytes) -> Request | None:
    """The request head at the start of data, once it is whole; None while incomplete or malformed."""
    end = data.find(b"\r\n\r\n")
    if end < 0 or end > MAX_HEAD:
        return None
    crlf = data.count(b"\r\n", 0, end)
    if data.count(b"\n", 0, end) != crlf or data.count(b"\r", 0, end) != crlf:
        return None     # a bare LF or CR: a server that ends lines at either would read other requests in it
    try:
        lines = data[:end].decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ")
        headers = []
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                return None
            headers.append((name, value.strip()))
    except ValueError:
        return None
    if not version.startswith("HTTP/1."):
        return None
    hosts = [v for n, v in headers if n.lower() == "host"]
    host = split_host(hosts[0])[0] if len(hosts) == 1 else None
    lengths = [v for n, v in headers if n.lower() == "content-length"]
    chunked = any(n.lower() == "transfer-encoding" for n, _ in headers)
    length: int | None = None
    if chunked or len(lengths) > 1 or (lengths and not (lengths[0].isascii() and lengths[0].isdigit()
                                                        and len(lengths[0]) <= 18)):
        length = -1
    elif lengths:
        length = int(lengths[0])
    return Request(method, target, version, host, headers, length, end + 4)


def absolute_http(target: str) -> tuple[str, str] | None:
    """An absolute-form target's (authority, path) when its scheme is http (in any case), else None."""
    scheme, sep, rest = target.partition("://")
    if not sep or scheme.lower() != "http":
        return None
    authority, slash, path = rest.partition("/")
    return authority, "/" + path if slash else "/"


def split_host(text: str, default_port: int = 0) -> tuple[str, int]:
    """'name:port' or '[v6]:port' -> (lower-case host, port or default_port); port -1 when malformed."""
    text = text.strip().lower()
    if text.startswith("["):
        close = text.find("]")
        host, rest = text[1:close], text[close + 1:]
    else:
        host, sep, rest = text.rpartition(":")
        if not sep:
            host, rest = text, ""
        else:
            rest = ":" + rest
    if rest and (not rest.startswith(":") or not rest[1:].isdigit() or not 0 < int(rest[1:]) < 65536):
        return host.rstrip("."), -1
    return host.rstrip("."), int(rest[1:]) if rest else default_port
