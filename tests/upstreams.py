"""Upstream servers for the network tests, run inside a network namespace the test made (never on a route
that leaves the machine): `python -m tests.upstreams LOG_DIR CERT KEY`.

On 198.51.100.2 (the namespace's address):
- :53/udp   DNS: the ZONE below, NXDOMAIN otherwise; every query name is logged (dns.log)
- :80       HTTP: answers "host=<Host> path=<path>"; every request's Host is logged (http.log)
- :443      HTTPS (the test CA's certificate for every *.test name): answers "tls host=<Host> sni=<SNI>"
- :3128     an open HTTP proxy (CONNECT to anything): a relay a sandbox must not chain through
- :7000     TCP echo
- :9999/udp counts datagrams (udp.log)
- :8080     a pypiserver index of wheels built here (make_wheel), its access log in pypi.log
- :8081     a Debian repository made here (make_debian_repo: suite `dsec`, package dsecdemo) under /debian
            (HTTP/1.1, connections kept open as a Debian mirror keeps them),
            its access log in debian.log
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import struct
import subprocess
import sys
from pathlib import Path

UP = "198.51.100.2"
ZONE = {"allowed.test": UP, "other.test": UP, "denied.test": UP, "proxy.test": UP, "cdn.allowed.test": UP,
        "rebind.test": "10.77.0.1", "metadata.test": "169.254.169.254"}


def log(name: str, line: str) -> None:
    with open(Path(sys.argv[1]) / name, "a") as f:
        f.write(line + "\n")


class Dns(asyncio.DatagramProtocol):
    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        qid, flags = struct.unpack(">HH", data[:4])
        pos, labels = 12, []
        while data[pos]:
            labels.append(data[pos + 1:pos + 1 + data[pos]].decode())
            pos += 1 + data[pos]
        qtype = struct.unpack(">H", data[pos + 1:pos + 3])[0]
        question = data[12:pos + 5]
        name = ".".join(labels).lower()
        log("dns.log", name)
        address = ZONE.get(name)
        if address is None:
            self.transport.sendto(struct.pack(">6H", qid, 0x8183, 1, 0, 0, 0) + question, addr)
            return
        answers = [struct.pack(">HHHIH", 0xC00C, 1, 1, 30, 4) + socket.inet_aton(address)] if qtype == 1 else []
        self.transport.sendto(struct.pack(">6H", qid, 0x8180, 1, len(answers), 0, 0) + question + b"".join(answers),
                              addr)


class UdpSink(asyncio.DatagramProtocol):
    def datagram_received(self, data: bytes, addr) -> None:
        log("udp.log", f"{addr[0]} {len(data)}")


async def _head(reader: asyncio.StreamReader) -> tuple[str, dict[str, str]]:
    line = (await reader.readline()).decode("latin-1").strip()
    headers = {}
    while (h := (await reader.readline()).decode("latin-1").strip()):
        k, _, v = h.partition(":")
        headers[k.strip().lower()] = v.strip()
    return line, headers


async def http(reader, writer, tls: bool = False) -> None:
    try:
        while True:
            line, headers = await _head(reader)
            if not line:
                break
            sni = writer.get_extra_info("ssl_object").server_hostname if tls else ""
            log("http.log", f"{'https' if tls else 'http'} {headers.get('host', '')} {line}")
            if int(headers.get("content-length", 0)):
                got = await reader.readexactly(int(headers["content-length"]))
                log("http.log", f"body {len(got)}")
            path = line.split(" ")[1]
            if path.startswith("/bytes/"):
                body = b"x" * int(path[7:])
            else:
                body = (f"{'tls ' if tls else ''}host={headers.get('host', '')} path={path}"
                        + (f" sni={sni}" if tls else "") + "\n").encode()
            writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()
            if headers.get("connection", "").lower() == "close":
                break
    except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
        pass
    finally:
        writer.close()


async def open_proxy(reader, writer) -> None:
    try:
        line, _ = await _head(reader)
        log("proxy.log", line)
        host, port = line.split(" ")[1].rsplit(":", 1)
        up_r, up_w = await asyncio.open_connection(ZONE.get(host, host), int(port))
        writer.write(b"HTTP/1.1 200 OK\r\n\r\n")

        async def pipe(r, w):
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
            w.close()
        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))
    except (ConnectionError, ValueError, OSError):
        writer.close()


async def echo(reader, writer) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


async def main() -> None:
    loop = asyncio.get_running_loop()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(sys.argv[2], sys.argv[3])
    seen = {}

    def sni_cb(sslobj, name, _ctx):
        seen[id(sslobj)] = name
    ctx.sni_callback = sni_cb
    await loop.create_datagram_endpoint(Dns, local_addr=(UP, 53))
    await loop.create_datagram_endpoint(UdpSink, local_addr=(UP, 9999))
    servers = [await asyncio.start_server(http, UP, 80),
               await asyncio.start_server(lambda r, w: http(r, w, True), UP, 443, ssl=ctx),
               await asyncio.start_server(open_proxy, UP, 3128),
               await asyncio.start_server(echo, UP, 7000)]
    print("ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def _wait_port(ns: str, port: int, timeout: float = 20.0) -> None:
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        probe = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c",
                                f"import socket; socket.create_connection(({UP!r}, {port}), 1)"], capture_output=True)
        if probe.returncode == 0:
            return
        time.sleep(0.2)
    raise RuntimeError(f"nothing answers on {UP}:{port} in {ns}")


def make_certs(d: Path) -> tuple[Path, Path]:
    """A test CA and a certificate for the *.test names it signs: (cert, key)."""
    conf = d / "san.cnf"
    conf.write_text("[req]\ndistinguished_name=dn\n[dn]\n[ext]\nsubjectAltName=DNS:*.test,DNS:allowed.test,"
                    "DNS:other.test,DNS:denied.test\n")
    _run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=dsec test CA",
         "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"))
    _run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=allowed.test", "-keyout",
         str(d / "leaf.key"), "-out", str(d / "leaf.csr"))
    _run("openssl", "x509", "-req", "-in", str(d / "leaf.csr"), "-CA", str(d / "ca.pem"), "-CAkey",
         str(d / "ca.key"), "-CAcreateserial", "-days", "2", "-extfile", str(conf), "-extensions", "ext",
         "-out", str(d / "leaf.pem"))
    return d / "leaf.pem", d / "leaf.key"


def make_wheel(d: Path, name: str = "dsecdemo", version: str = "1.0", payload: int = 1 << 20) -> Path:
    """A pure-Python wheel of `name`, built here (a zip with its dist-info), with `payload` bytes of data."""
    import base64
    import hashlib
    import os
    import zipfile
    files = {f"{name}/__init__.py": f"VERSION = {version!r}\n".encode(),
             f"{name}/data.bin": os.urandom(payload),
             f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                                     .encode(),
             f"{name}-{version}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: dsec-tests\nRoot-Is-Purelib: "
                                                  b"true\nTag: py3-none-any\n"}
    record = "".join(f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
                     f"{len(data)}\n" for path, data in files.items())
    files[f"{name}-{version}.dist-info/RECORD"] = (record + f"{name}-{version}.dist-info/RECORD,,\n").encode()
    out = d / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for path, data in files.items():
            z.writestr(path, data)
    return out


def make_debian_repo(d: Path, payload: int = 1 << 20) -> Path:
    """A Debian repository (dpkg-deb, apt-ftparchive) at d/debian: suite `dsec`, component main, one package
    dsecdemo 1.0 (all) installing /usr/share/dsecdemo/data.bin of `payload` bytes; unsigned (apt needs
    [trusted=yes] for it)."""
    import lzma
    import os
    pkg, repo = d / "debpkg", d / "debian"
    (pkg / "DEBIAN").mkdir(parents=True, exist_ok=True)
    (pkg / "usr/share/dsecdemo").mkdir(parents=True, exist_ok=True)
    (pkg / "DEBIAN/control").write_text("Package: dsecdemo\nVersion: 1.0\nArchitecture: all\nMaintainer: dsec tests "
                                        "<tests@example.invalid>\nDescription: a package built by the tests\n")
    (pkg / "usr/share/dsecdemo/data.bin").write_bytes(os.urandom(payload))
    (repo / "pool/main").mkdir(parents=True, exist_ok=True)
    _run("dpkg-deb", "-b", "-Zgzip", str(pkg), str(repo / "pool/main/dsecdemo_1.0_all.deb"))
    dist = repo / "dists/dsec"
    for arch in ("amd64", "all"):
        out = dist / f"main/binary-{arch}"
        out.mkdir(parents=True, exist_ok=True)
        packages = subprocess.run(["apt-ftparchive", "packages", "pool"], cwd=repo, check=True,
                                  capture_output=True).stdout
        (out / "Packages").write_bytes(packages)      # listed in Release as Debian's is (apt's key for the index)
        (out / "Packages.xz").write_bytes(lzma.compress(packages))   # what apt fetches
    release = subprocess.run(["apt-ftparchive", "-o", "APT::FTPArchive::Release::Suite=dsec",
                              "-o", "APT::FTPArchive::Release::Codename=dsec",
                              "-o", "APT::FTPArchive::Release::Components=main",
                              "-o", "APT::FTPArchive::Release::Architectures=amd64 all", "release", "."],
                             cwd=dist, check=True, capture_output=True).stdout
    (dist / "Release").write_bytes(release)
    return repo


@contextlib.contextmanager
def running(d: Path, ns: str = "aetherup", link: str = "aetherup0"):
    """The upstream namespace `ns` (UP; the host end .1 on `link`) with these servers; yields the logs' dir.
    Everything goes with the namespace."""
    (d / "logs").mkdir(exist_ok=True)
    cert, key = make_certs(d)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    _run("ip", "netns", "add", ns)
    proc = index = debian = None
    try:
        _run("ip", "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "addr", "add", "198.51.100.1/24", "dev", link)
        _run("ip", "link", "set", link, "up")
        for cmd in (["ip", "addr", "add", f"{UP}/24", "dev", "eth0"], ["ip", "link", "set", "eth0", "up"],
                    ["ip", "link", "set", "lo", "up"]):
            _run("ip", "netns", "exec", ns, *cmd)
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "tests.upstreams", str(d / "logs"),
                                 str(cert), str(key)], stdout=subprocess.PIPE, cwd=Path(__file__).parent.parent)
        if proc.stdout.readline().strip() != b"ready":
            raise RuntimeError("the upstream servers did not start")
        (d / "wheels").mkdir(exist_ok=True)
        make_wheel(d / "wheels")
        index = subprocess.Popen(["ip", "netns", "exec", ns, str(Path(sys.executable).parent / "pypi-server"), "run",
                                  "-v", "-i", UP, "-p", "8080", "-a", ".", "-P", ".", "--disable-fallback",
                                  "--log-file", str(d / "logs" / "pypi.log"),
                                  str(d / "wheels")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        make_debian_repo(d)
        with open(d / "logs" / "debian.log", "ab") as access:
            debian = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "tests.upstreams", "--files",
                                       str(d)], stdout=access, stderr=access, cwd=Path(__file__).parent.parent)
        _wait_port(ns, 8080)
        _wait_port(ns, 8081)
        yield d / "logs"
    finally:
        for p in (proc, index, debian):
            if p is not None:
                p.kill()
                p.wait()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def serve_files(root: str) -> None:
    """The Debian repository's server: files under root on UP:8081, HTTP/1.1 with connections kept open after a
    404 too, as a Debian mirror keeps them (http.server closes one after any error, and a caching proxy that
    sent several requests on it sees the rest fail); requests logged to stderr."""
    import functools
    import http.server

    class Handler(http.server.SimpleHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def send_error(self, code, message=None, explain=None):
            body = f"{code} {message or ''}\n".encode()
            self.log_error("code %d, message %s", code, message)
            self.send_response(code, message)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

    http.server.ThreadingHTTPServer((UP, 8081), functools.partial(Handler, directory=root)).serve_forever()


if __name__ == "__main__":
    if sys.argv[1] == "--files":
        serve_files(sys.argv[2])
    else:
        asyncio.run(main())
