"""Host-wide leak accounting for the test suite.

Fixtures that keep a node alive across tests (the session stack, a module's backend, a module's
`dsec up`) register it in LIVE with its state dir; after every test, anything of DSec on the host
that belongs to no live node is a leak: dsec-<node> cgroups, sandbox inits (catatonit), zygotes,
erofs/overlay/btrfs mounts under a temp dir, and uid range leases (not draining ones).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import psutil

from edge.backends import idmap
from edge.backends.cgroups import own_paths

LIVE: dict[str, Path] = {}   # node id -> state dir of the backend (mounts under it are its own)
# Nodes someone else runs on this host meanwhile (a developer's own `dsec up`, an experiment): theirs,
# never this session's leaks. DSEC_TEST_FOREIGN="node=/its/state/dir,..." names them.
for _item in filter(None, os.environ.get("DSEC_TEST_FOREIGN", "").split(",")):
    _node, _, _dir = _item.partition("=")
    LIVE[_node] = Path(_dir or "/nonexistent").resolve()
BEFORE: set[str] = set()     # residue already on the host when the session began (a killed earlier run's)

MOUNT_TYPES = ("erofs", "overlay", "btrfs", "fuse")   # fuse: a lazily loaded layer's (edge/lazyfuse.py)


@contextlib.contextmanager
def live(node: str, state_dir: Path):
    """Register a node as alive for the duration of a fixture."""
    LIVE[node] = Path(state_dir).resolve()
    try:
        yield
    finally:
        LIVE.pop(node, None)


def is_live(node: str | None) -> bool:
    """A node of a live fixture, or a part of one (`t1.fn`: the fncall workers of node t1)."""
    return node is not None and (node in LIVE or node.split(".", 1)[0] in LIVE)


def _node_of_cgroup(pid: int) -> str | None:
    try:
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            for part in line.split(":", 2)[2].split("/"):
                if part.startswith("dsec-"):
                    return part[5:]
    except OSError:
        return None
    return None


def note_before() -> list[str]:
    """Record what is already on the host before any test runs: residue of an earlier run that was
    killed (SIGKILL leaves its mounts and cgroups) is not this session's leak. Returns it, to report."""
    BEFORE.clear()
    BEFORE.update(_residue())
    return sorted(BEFORE)


def host_leaks() -> list[str]:
    """What DSec left on the host during this session that no live node owns."""
    return [r for r in _residue() if r not in BEFORE]


def _residue() -> list[str]:
    out: list[str] = []
    for base in own_paths().values():
        out += [f"cgroup {g}" for g in base.glob("dsec-*") if not is_live(g.name[5:])]
    for proc in psutil.process_iter(["pid", "ppid", "cmdline"]):
        cmd = proc.info["cmdline"] or []
        if cmd[:1] == ["dsec-enter"] and proc.info["ppid"] == 1:   # its edge is gone: a helper left behind
            out.append(f"exec helper pid {proc.info['pid']} ({' '.join(cmd[:3])})")
        if cmd[:1] == ["catatonit"] and not is_live(_node_of_cgroup(proc.info["pid"])):
            out.append(f"sandbox init pid {proc.info['pid']}")
        if cmd[:1] and cmd[0].endswith("qemu-system-x86_64") and not is_live(_node_of_cgroup(proc.info["pid"])):
            out.append(f"qemu pid {proc.info['pid']} ({' '.join(cmd[cmd.index('-name') + 1:][:1] if '-name' in cmd else cmd[:1])})")
        if "edge.fence" in cmd and "--node" in cmd and not is_live(cmd[cmd.index("--node") + 1]):
            out.append(f"fence pid {proc.info['pid']} (node {cmd[cmd.index('--node') + 1]})")
        if "edge.backends.zygote" in cmd and not is_live(cmd[-1].rsplit(":", 1)[-1]):
            out.append(f"zygote pid {proc.info['pid']} ({cmd[-1]})")
        if "aether.pipmirror" in cmd or (cmd[:1] and cmd[0].endswith("apt-cacher-ng")):   # a node's mirrors
            try:
                mirror_node = proc.environ().get("DSEC_MIRROR_NODE")
            except psutil.Error:
                mirror_node = None
            if mirror_node is not None and not is_live(mirror_node):
                out.append(f"mirror pid {proc.info['pid']} ({' '.join(cmd[:4])}; node {mirror_node})")
        if cmd[:1] and cmd[0].endswith("nats-server") and proc.info["ppid"] == 1 and "/dsec-" in " ".join(cmd):
            out.append(f"nats-server pid {proc.info['pid']} (its test or stack is gone)")
        if "edge.lazyfuse" in cmd and "--dir" in cmd:       # a lazily loaded layer's FUSE process
            where = cmd[cmd.index("--dir") + 1]
            if not any(where.startswith(str(p) + "/") for p in LIVE.values()):
                out.append(f"lazy layer pid {proc.info['pid']} ({where})")
        if "aether.serve" in cmd and "--node" in cmd and not is_live(cmd[cmd.index("--node") + 1]):
            out.append(f"aether proxy pid {proc.info['pid']} (node {cmd[cmd.index('--node') + 1]})")
    for i, (node, key) in sorted(idmap.leases().items()):
        if not is_live(node) and key != idmap.DRAINING:
            out.append(f"uid range lease {i} of node {node} ({key})")
    out += _network_residue()
    owned = [str(p) + "/" for p in LIVE.values()]
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            fstype, point = fields[fields.index("-") + 1], fields[4]
            if fstype in MOUNT_TYPES and point.startswith("/tmp/") and not any(point.startswith(o) for o in owned):
                out.append(f"{fstype} mount {point}")
            parts = point.split("/")   # a gVisor sandbox's root: /run/dsec/gvisor/<node>.gvisor/<sandbox>
            if point.startswith("/run/dsec/gvisor/") and len(parts) > 4 and not is_live(parts[4]):
                out.append(f"{fstype} mount {point}")
    return out


def _network_residue() -> list[str]:
    """Aether's host-side parts (aether/): veths, nft tables and /16 reservations of no live node."""
    from aether import links, rules
    from aether.nft import NftError
    live = list(LIVE) + [n.split(".", 1)[0] for n in LIVE]
    prefixes = {links.link_prefix(n) for n in live}
    out = [f"veth {p.name}" for p in Path("/sys/class/net").iterdir()
           if p.name.startswith(links.PREFIX) and len(p.name) > 8 and p.name[:8] not in prefixes]
    try:
        tables = rules.tables()
    except NftError:
        tables = []
    out += [f"nft table {t}" for t in tables if t not in {rules.table_name(n) for n in live}]
    marks = {links.route_mark(n) for n in live}
    out += [f"route reservation {net} (mark {mark})" for mark, net in _in_thread(links.reservations).items()
            if mark not in marks]
    return out


def _in_thread(fn):
    """pyroute2's blocking calls must not run on a thread with a running event loop (the test's)."""
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(fn).result()
