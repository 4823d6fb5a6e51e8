"""Shared fixtures: a real nats-server per session, a real stack (placement + edge + container backend),
and a leak check after every test."""
from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from bus.server import NatsServer, free_port
from tests import leaks

NODE = "t1"

# The long tier: `make test-long` runs it; CI (`make test`) does not, its budget being 30 minutes on a machine
# where everything took 38. In it: a kind's cell whose path another kind's cell covers in CI (a full VM's agent,
# network and snapshots are a microVM's, each new VM template a boot of 20-40 s under TCG; the network attacks
# of the kinds whose traffic meets the container's rules), the 3-server chaos runs, and single scenarios of
# 15-36 s each (a sandbox's empty files and btrfs, records without quorum, the SDK's own venv, E2B on a fresh
# `dsec up`, a microVM's edge SIGKILLed). Each says so where it is marked.
LONG = pytest.mark.long


def long_for(kinds: list[str], *heavy: str) -> list:
    """kinds as pytest parameters, those in heavy marked `long`."""
    return [pytest.param(k, marks=LONG) if k in heavy else k for k in kinds]


# The network tests' upstream servers (tests/upstreams.py) live in a namespace of their own on this range,
# which the session edge's operator allows (--aether-allow-cidr); nothing routes it off the machine.
UPSTREAM_RANGE = "198.51.100.0/24"
UPSTREAM = "198.51.100.2"
# The tenants the suite acts as (each its own NATS account, with its credential under the session state dir).
TENANTS = ["default", "tenant-b", "t", "quota-t", "quota-u", "quota-n", "quota-c", "slow", "legacy", "fnfree", "fnq",
           "flooder", "paged", "alice", "mallory"]


def pytest_sessionstart(session):
    """Residue of an earlier, killed run is reported once and not counted as any test's leak. Edges run in
    this process are not fenced (the session loop sits idle between tests: their fences would end their
    sandboxes); those the tests start as processes are (edge/fence.py)."""
    import edge.fence
    edge.fence.ENABLED = False
    found = leaks.note_before()
    if found:
        print(f"\nnote: {len(found)} leftovers of an earlier run on this host (not counted as leaks):")
        for r in found[:10]:
            print(f"  {r}")


@pytest.fixture(scope="session")
def session_dir():
    """A temp dir for the whole session (removed at the end)."""
    d = Path(tempfile.mkdtemp(prefix="dsec-test-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def hostile(session_dir) -> bytes:
    """The attack tests' toolbox (tests/attacks/hostile.c), compiled static and stripped for any image."""
    out = session_dir / "hostile"
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "the attack tests need a C compiler (make setup installs gcc)"
    subprocess.run([cc, "-Os", "-s", "-static", "-o", str(out), str(Path(__file__).parent / "attacks" / "hostile.c")],
                   check=True)
    return out.read_bytes()


@pytest.fixture(scope="session")
def nats_server(session_dir):
    """A real nats-server with JetStream on a free port, enforcing identities (bus/iam.py) as `dsec up` does:
    the SDK finds its tenant's credential under $DSEC_STATE_DIR (set to the session's state dir), tests'
    own connections use `srv.admin`."""
    from bus import iam
    state = session_dir / "state"
    ids = iam.bootstrap(state, nodes=[NODE], tenants=TENANTS)
    srv = NatsServer(session_dir / "nats", port=free_port(), iam=ids).start()
    srv.iam, srv.admin = ids, str(ids.creds_path("admin"))
    os.environ["DSEC_STATE_DIR"] = str(state)
    yield srv
    srv.stop()
    refused = sorted({line.split(" - ", 2)[-1] for line in srv.log_file.read_text(errors="replace").splitlines()
                      if "Violation" in line})
    if refused:   # what the server refused this session (the attack tests' attempts among them)
        print(f"\nnats-server refused {len(refused)} distinct operations this session:")
        for line in refused[:60]:
            print(f"  {line[:200]}")


async def raw_nats(url: str, **options):
    """A plain nats-py connection as admin (the credential under $DSEC_STATE_DIR), for tests that speak
    the wire themselves."""
    import nats
    from bus.creds import credential_options, default_creds
    return await nats.connect(url, **credential_options(default_creds("admin")), **options)


def own_server(root: Path, nodes: list[str]) -> NatsServer:
    """A NATS server of one test's own (it kills or restarts it), enforcing identities as `dsec up` does:
    made under root/iam before it starts, for the given edge nodes; srv.creds(principal) is a principal's
    credential file (`admin`, `placement`, `edge-<node>`, `tenant:default`)."""
    from bus import iam
    ids = iam.bootstrap(root / "iam", nodes=nodes)
    srv = NatsServer(root / "nats", port=free_port(), iam=ids).start()
    srv.creds = lambda principal: str(ids.creds_path(principal))
    return srv


def edge_creds(srv, node: str) -> str:
    """An edge credential for one more node (the server reloaded with it)."""
    from bus import iamserver
    if f"edge-{node}" not in srv.iam.platform:
        srv.iam.issue_platform(f"edge-{node}")
        srv.iam.save()
        iamserver.reload(srv.iam)
    return str(srv.iam.creds_path(f"edge-{node}"))


@pytest.fixture(scope="session")
async def stack(nats_server, session_dir):
    """Placement + one edge (container backend) on the session server; torn down and leak-checked at the end."""
    from cli.stack import Stack
    from edge.capacity import EdgeConfig
    st = Stack(session_dir / "state", nats_url=nats_server.url, metrics_port=None,
               edge_config=EdgeConfig(node_id=NODE, slots=64, aether_dns=f"{UPSTREAM}:53",
                                      aether_allow_cidr=[UPSTREAM_RANGE],
                                      mirror_pypi=f"http://{UPSTREAM}:8080/simple/",
                                      mirror_apt=f"http://{UPSTREAM}:8081/debian"))
    st.edge_creds = lambda node: edge_creds(nats_server, node)
    st.nats_server = nats_server
    with leaks.live(NODE, session_dir / "state"):   # its kinds keep state in edge/, edge-fncall/...
        await st.start()
        yield st
        await st.stop()
    from edge.backends.registry import node_leftovers
    assert node_leftovers(session_dir / "state" / "edge", NODE) == []


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    """The network tests' upstream namespace (UPSTREAM, the host end .1) and its servers (tests/upstreams.py):
    their logs' directory."""
    from tests import upstreams
    with upstreams.running(tmp_path_factory.mktemp("upstream")) as logs:
        yield logs


@contextlib.asynccontextmanager
async def extra_edge(stack, state_dir: Path, node: str, slots: int, backends: list[str] | None = None,
                     options: dict | None = None, creds: str | None = None, **config):
    """Another node on the session's bus (its own edge process part, no placement), stopped after; it runs
    the backend kinds given (default: container), each with its options ({kind: {field: value}})."""
    from cli.stack import Stack
    from edge.backends.registry import config_for
    from edge.capacity import EdgeConfig
    kinds = backends or ["container"]
    config.setdefault("mirrors", False)   # a pip mirror per extra node: only where a test asks for one
    config.setdefault("aether", False)    # sandbox networks too (their pools' namespaces cost every node's start)
    st = Stack(state_dir, nats_url=stack.url, metrics_port=None, run_placement=False,
               edge_config=EdgeConfig(node_id=node, slots=slots, backends=kinds, **config),
               backends=[config_for(k, **(options or {}).get(k, {})) for k in kinds],
               creds=creds or stack.edge_creds(node))
    with leaks.live(node, state_dir):
        await st.start()
        try:
            yield st
        finally:
            await st.stop()


class KindNodes:
    """One node per kind that runs a guest (gvisor, microvm, fullvm), shared by the tests of tests/backends
    that ask (kind_nodes.get), started at the first ask and stopped once the next test is elsewhere or makes
    such nodes of its own (a module's OWN_NODES): each template boots once there, not once a module (a full
    VM's first create took 20-40 s of each module that used one, under TCG: CI's budget is 30 minutes)."""
    SLOTS = {"gvisor": 16, "microvm": 24, "fullvm": 8}

    def __init__(self):
        self.nodes: dict = {}
        self.base: Path | None = None    # (pytest's temp dir: like any other extra node's)
        self._held = contextlib.AsyncExitStack()

    async def get(self, stack, kind: str):
        if kind not in self.nodes:
            state = Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=self.base))
            self.nodes[kind] = await self._held.enter_async_context(
                extra_edge(stack, state, f"k-{kind}", self.SLOTS[kind], backends=[kind]))
        return self.nodes[kind]

    async def stop(self) -> None:
        self.nodes.clear()
        held, self._held = self._held, contextlib.AsyncExitStack()
        await held.aclose()

    def wanted_by(self, item) -> bool:
        """Whether the test `item` (the next one) may find the nodes running."""
        return (item is not None and Path(item.path).parent == Path(__file__).parent / "backends"
                and not getattr(item.module, "OWN_NODES", False))


KIND_NODES = KindNodes()
NEXT_TEST: list = [None]     # the test that runs after the current one (pytest_runtest_protocol)


def pytest_runtest_protocol(item, nextitem):
    NEXT_TEST[0] = nextitem


@pytest.fixture(scope="session")
async def kind_nodes(stack, tmp_path_factory):
    KIND_NODES.base = tmp_path_factory.mktemp("kind-nodes")
    yield KIND_NODES
    await KIND_NODES.stop()


@pytest.fixture
async def second_edge(stack, tmp_path):
    """Node t2, smaller than t1, so placement's best fit fills it first. It holds the busybox layer as t1
    does (placement prefers a node that needs no fetch when fits are close)."""
    async with extra_edge(stack, tmp_path / "t2", "t2", 10) as st:
        await hold_layers(stack, st, "busybox")
        yield st


async def ended_record(client, sandbox_id: str, within: float = 30.0):
    """The sandbox's record once it is no longer `ready` (a sandbox that ended by itself), or as it is
    after `within` seconds."""
    for _ in range(int(within * 10)):
        rec = await client._record(sandbox_id)
        if rec.state != "ready":
            return rec
        await asyncio.sleep(0.1)
    return rec


async def hold_layers(stack, other, image: str) -> None:
    """Have another node fetch an image's layers, and wait until its node record (what placement sees)
    lists them."""
    from bus import streams
    from bus.records import layer_mark, node_decoder
    from bus.images import ImageRegistry
    layers = await ImageRegistry(stack.bus).compose(image)
    await other.edge.layers.ensure(layers)
    marks = {layer_mark(la.digest) for la in layers}
    for _ in range(200):
        if marks <= set(node_decoder.decode(await stack.bus.kv_get(streams.NODES_KV, other.edge.node)).layers):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{other.edge.node}'s node record never listed the layers of {image}")


@pytest.fixture
async def client(stack):
    """A connected AsyncClient."""
    import libdsec
    async with libdsec.AsyncClient(stack.url) as c:
        yield c


@pytest.fixture
def e2b_env(stack, monkeypatch):
    """`import e2b` is the facade (libdsec.e2b.install()), against the session stack, for one test."""
    monkeypatch.setenv("DSEC_URL", stack.url)
    import libdsec.e2b
    libdsec.e2b.install()
    yield
    for name in [m for m in sys.modules if m == "e2b" or m.startswith("e2b.")]:
        del sys.modules[name]


@pytest.fixture(autouse=True)
async def no_leaks(request):
    """After every test: nothing of DSec on the host that no live fixture owns; and when the test used
    the session stack, no sandbox left and no per-sandbox residue of it."""
    yield
    if KIND_NODES.nodes and not KIND_NODES.wanted_by(NEXT_TEST[0]):
        await KIND_NODES.stop()
    assert leaks.host_leaks() == [], "left on the host"
    if "stack" not in request.fixturenames:
        return
    st = request.getfixturevalue("stack")
    if st.edge is None:
        return
    backend = st.edge.backend   # every kind's, asked through the backend interface (busy, leaks)
    for _ in range(50):   # destroys triggered at the end of a test may still be settling (dying ones too)
        if not st.edge.sandboxes and not backend.busy() and not st.edge.warm.filling:
            break
        await asyncio.sleep(0.1)
    left = list(st.edge.sandboxes)
    for sid in left:      # clean up so one leaky test does not fail the rest
        await st.edge.destroy(sid)
    assert left == [], f"test left sandboxes running: {left}"
    assert sandbox_cgroups(NODE) == [], "per-sandbox cgroups left behind"
    assert host_residue(st.state_dir) == [], "host residue left behind"
    assert backend.leaks() == [], "the backends hold what no sandbox uses"
    if st.edge.network.aether is not None:
        assert st.edge.network.aether.leaks() == [], "sandbox networks no sandbox uses"


def host_residue(state_dir: Path) -> list[str]:
    """Sandbox mounts (overlay, EROFS layers) under the state dir, dsec netns and veths on the host.

    The node-level writable-layer pool (btrfs) and idle layer mounts (a bounded cache under
    <state>/edge/layers) stay while the edge runs; overlays live only in sandbox mount namespaces.
    """
    out = []
    layer_cache = str(state_dir / "edge" / "layers") + "/"
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            fstype = fields[fields.index("-") + 1]
            point = fields[4]
            if fstype == "erofs" and point.startswith(layer_cache):
                continue
            parts = point.split("/")   # a gVisor root of a live node (/run/dsec/gvisor/<node>.gvisor/...) is its own
            if point.startswith("/run/dsec/gvisor/") and len(parts) > 4 and leaks.is_live(parts[4]):
                continue
            if point.startswith("/tmp/dsec-test-") and not point.startswith(str(state_dir.parent) + "/"):
                continue          # another test session's (a second run on this host): its own check's to judge
            if fstype in ("overlay", "erofs") and (str(state_dir) in point or "dsec" in point):
                out.append(f"{fstype} mount {point}")
    netns = Path("/run/netns")
    if netns.is_dir():
        out += [f"netns {p.name}" for p in netns.iterdir() if "dsec" in p.name]
    out += [f"veth {p.name}" for p in Path("/sys/class/net").iterdir()
            if "dsec" in p.name]
    return out


def sandbox_cgroups(node: str) -> list[str]:
    """Per-sandbox cgroup dirs under any dsec-<node> group (in its shards), in every v1 hierarchy."""
    from edge.backends.cgroups import NodeCgroups
    return [str(p) for p in NodeCgroups(node).sandbox_groups()]

