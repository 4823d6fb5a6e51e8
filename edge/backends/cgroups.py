"""cgroup v1 tree of one node: <own>/dsec-<node>/g<shard>/<sandbox>/x<n> in every controller we use, and
<own>/dsec-<node>.batch/g<shard>/<sandbox>/x<n> for batch sandboxes (CPU classes, below).

Groups are created below the cgroup this process runs in (read from /proc/self/cgroup), never at a
hierarchy root: on this machine memory is delegated at /process_api/<id>, the others at /.
The freezer is what makes killing a process tree reliable: a frozen group cannot fork, so one pass
of SIGKILL over its pids catches every process, reparented orphans included.

Sandboxes sit in SHARDS groups by a hash of their key, not all side by side: a cpuset mkdir (clone_children)
walks every sibling, ~40 us per 1,000 here, which a node holding 10,000 sandboxes paid on each create.
A sandbox has the same relative path in every hierarchy (lxcfs reads the cpu quota at the cpuset path).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
import zlib
from pathlib import Path

from edge.backends.hosttables import lift_host_tables, node_tasks
from edge.backends.base import Limits

log = logging.getLogger(__name__)

ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("cpu", "cpuacct", "memory", "pids", "freezer", "devices", "blkio", "cpuset")
# An exec gets its own child group only where it needs one: freezer (kill its tree), cpuacct and
# memory (its cpu time and peak), pids and memory (its limit events). In cpu and devices it joins
# the sandbox's group: fewer mkdir/rmdir/attach per exec (and in blkio).
EXEC_CONTROLLERS = ("cpuacct", "memory", "pids", "freezer")
# CPU classes: batch sandboxes live in a tree of their own, dsec-<node>.batch, a sibling of the edge's own
# processes and of the latency sandboxes' dsec-<node>, whose cpu group gets the smallest cpu.shares and, where
# the kernel has it (5.15+), cpu.idle (the group is SCHED_IDLE towards its siblings: a waking task of the edge,
# of NATS or of a latency sandbox preempts it at once; its shares then read 3). Not inside dsec-<node>: the
# scheduler weighs siblings only, and there the node group, busy with batch work alone, competed with the
# edge and NATS as one normal entity (a command's helper waited a whole tick, ~4 ms, behind a batch `yes`).
# Inside the batch tree batch sandboxes share alike. Each of its processes runs at SCHED_IDLE (set by its
# init's launch and every exec: the zygote, dsec-enter, the runsc and QEMU launches), which a process may not
# leave (RLIMIT_NICE 0, no CAP_SYS_NICE on the host). Core scheduling would keep batch work off a latency
# sandbox's SMT sibling; this kernel lacks it (and this machine has no SMT).
BATCH_SHARES = 2
BATCH_SUFFIX = ".batch"
SHARDS = 16   # groups the sandboxes of a node are spread over (see the module's text); each memcg costs the
              # host a shrinker map (edge/backends/nodemounts.py), so not more than needed


def shard(key: str) -> str:
    """The shard group of a sandbox key (stable: the key never changes, also when a warm one is claimed)."""
    return f"g{zlib.crc32(key.encode()) % SHARDS:02d}"


# I/O a sandbox may make on the writable-layer pool's loop device (cgroup v1 blkio throttling). v1 throttles
# what reaches the device in the sandbox's name: direct and synchronous writes (O_DIRECT, O_SYNC, fsync);
# buffered writes are written back by the kernel's flusher, charged to no sandbox (docs/architecture.md).
IO_LIMITS = (("blkio.throttle.write_bps_device", 64 << 20), ("blkio.throttle.read_bps_device", 256 << 20),
             ("blkio.throttle.write_iops_device", 2000), ("blkio.throttle.read_iops_device", 8000))
# Device nodes a sandbox may open (mknod of anything is allowed, opening it is not):
# null zero full random urandom tty ptmx, and the devpts ptys. Not 5:1 (the host console).
DEVICE_RULES = ("c *:* m", "b *:* m", "c 1:3 rwm", "c 1:5 rwm", "c 1:7 rwm", "c 1:8 rwm",
                "c 1:9 rwm", "c 5:0 rwm", "c 5:2 rwm", "c 136:* rwm")


# Where v1 records that a limit fired: (controller, file, key or None for a plain number, our name).
# v1 counts pids "max" and oom kills in the group of the forking / killed task (the exec group),
# not in the group that holds the limit, so exec groups' counts are collected before removal.
EVENTS = (("pids", "pids.events", "max", "pids_max"),
          ("memory", "memory.oom_control", "oom_kill", "oom_kill"),
          ("memory", "memory.failcnt", None, "memory_failcnt"),
          ("memory", "memory.memsw.failcnt", None, "memsw_failcnt"))


class CgroupError(Exception):
    """A cgroup could not be created, limited or removed."""


def own_paths() -> dict[str, Path]:
    """Directory of the cgroup this process is in, per controller we use."""
    found: dict[str, Path] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, names, rel = line.rstrip("\n").split(":", 2)
            for name in names.split(","):
                if name in CONTROLLERS:
                    found[name] = ROOT / name / rel.lstrip("/")
    missing = [c for c in CONTROLLERS if c not in found or not (ROOT / c).is_dir()]
    if missing:
        raise CgroupError(f"cgroup v1 controllers not mounted: {', '.join(missing)}")
    return found


def write(path: Path, value: str) -> None:
    """Write one cgroup control file."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def read(path: Path | str) -> str:
    """Read one cgroup control file ('' if the group is gone). Plain fd calls: an exec reads several
    per command, and io.open's layers cost more than the read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, ProcessLookupError):
        return ""
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks).decode()
    except ProcessLookupError:
        return ""
    finally:
        os.close(fd)


class CallGroup:
    """A worker's one exec group, kept for all its calls, with its two count files held open: a call resets
    and reads each with one pwrite or pread (kernfs makes a read from offset 0 anew, once a read moved the
    file's position: these files are never empty) instead of an open, a read and a close. cgroup.procs is
    opened per look: an empty read leaves its position at 0, and a read from 0 would then go on from the
    end of the previous list."""

    def __init__(self, groups: dict[str, Path]) -> None:
        self.groups = groups
        self._fds: list[int] = []
        try:
            for name in ("cpuacct/cpuacct.usage", "memory/memory.max_usage_in_bytes"):
                controller, _, file = name.partition("/")
                self._fds.append(os.open(groups[controller] / file, os.O_RDWR | os.O_CLOEXEC))
        except OSError:
            self.close()
            raise
        self._usage, self._peak = self._fds

    def reset_stats(self) -> None:
        """Start the CPU and peak-memory counts afresh (before a call)."""
        os.pwrite(self._usage, b"0", 0)
        os.pwrite(self._peak, b"0", 0)

    def stats(self) -> tuple[float, int]:
        """CPU seconds and peak memory bytes since the last reset (0, 0 once the group is gone)."""
        try:
            usage, peak = os.pread(self._usage, 64, 0).strip(), os.pread(self._peak, 64, 0).strip()
        except OSError:
            return 0.0, 0
        return (int(usage) / 1e9 if usage else 0.0), (int(peak) if peak else 0)

    def procs(self) -> list[int]:
        """Pids in the group now."""
        return procs(self.groups["freezer"])

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def procs(group: Path) -> list[int]:
    """Pids directly in one group."""
    return [int(p) for p in read(f"{group}/cgroup.procs").split()]


def procs_under(group: Path) -> list[int]:
    """Pids in a group and all its descendants."""
    pids: list[int] = []
    for dirpath, _, _ in os.walk(group):
        pids.extend(procs(Path(dirpath)))
    return pids


def rmdir_tree(group: Path) -> list[str]:
    """Remove a group and its descendants, deepest first; return those that stay (busy)."""
    busy: list[str] = []
    try:
        os.rmdir(group)             # the common case: a leaf group
        return busy
    except FileNotFoundError:
        return busy
    except OSError:
        pass                        # has child groups (or processes): go deepest first
    for dirpath, _, _ in sorted(os.walk(group), key=lambda w: -len(w[0])):
        try:
            os.rmdir(dirpath)
        except FileNotFoundError:
            pass
        except OSError as exc:
            busy.append(f"{dirpath}: {exc.strerror}")
    return busy


KILL_TIMEOUT = 10.0   # seconds kill_tree waits for a group's killed processes to be gone


async def kill_tree(freezer: Path, timeout: float = KILL_TIMEOUT, init: int | None = None) -> bool:
    """SIGKILL every process under a freezer group and wait until none is left; False if some survive.

    init: the pid-namespace init of the group, if any. Killed first, it makes the kernel kill its
    whole namespace and refuse new pids there, so no freeze is needed (freezing a group whose exec
    child group was just removed waits an RCU grace period, ~15 ms, for the dying child).
    """
    deadline = time.monotonic() + timeout
    signalled: set[int] = set()
    next_sweep = 0.0
    if init is not None:
        for pid in [init, *procs_under(freezer)]:
            _kill(pid)
            signalled.add(pid)
        next_sweep = time.monotonic() + 0.05
    while pids := procs_under(freezer):
        now = time.monotonic()
        if now > deadline:
            return False
        # Freeze and kill again only for pids not signalled yet (a fork that slipped in), or
        # every 50 ms in case a pid was reused; otherwise the killed tasks are just dying.
        if not signalled.issuperset(pids) or now > next_sweep:
            outlived = signalled.issuperset(pids)   # (all of them were killed before: something holds them)
            await _set_frozen(freezer, True, deadline)
            for pid in procs_under(freezer):
                _kill(pid)
                signalled.add(pid)
            await _set_frozen(freezer, False, deadline)
            if outlived:
                _thaw_below(freezer)
            next_sweep = now + 0.05
        await asyncio.sleep(0.001)
    return True


def _thaw_below(freezer: Path) -> None:
    """Thaw every group under freezer frozen by itself (a suspended sandbox, or a kill an edge that died left
    half done): thawing a parent leaves those frozen, and their killed tasks wait, frozen, for ever. A
    restarted edge so could not clean its node up ("processes survive") and did not start."""
    for flag in freezer.rglob("freezer.self_freezing"):
        with contextlib.suppress(OSError):
            if flag.read_text().strip() == "1":
                write(flag.parent / "freezer.state", "THAWED")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def _set_frozen(group: Path, frozen: bool, deadline: float) -> None:
    """Freeze or thaw a group; when freezing wait (bounded) until FROZEN so no fork slips through."""
    state = "FROZEN" if frozen else "THAWED"
    try:
        write(group / "freezer.state", state)
    except FileNotFoundError:
        return
    # A task in uninterruptible sleep can keep the group FREEZING; kill anyway after a second
    # (its SIGKILL lands when it wakes) and let the caller's loop sweep again.
    deadline = min(deadline, time.monotonic() + 1.0)
    while frozen and read(group / "freezer.state").strip() == "FREEZING":
        if time.monotonic() > deadline:
            return
        await asyncio.sleep(0.0005)


async def freeze(group: Path, timeout: float = 5.0) -> bool:
    """Freeze a group and its descendants; True once every task is frozen (False: still FREEZING)."""
    write(group / "freezer.state", "FROZEN")
    deadline = time.monotonic() + timeout
    while read(group / "freezer.state").strip() != "FROZEN":
        if time.monotonic() > deadline:
            return False
        write(group / "freezer.state", "FROZEN")   # a task that was in uninterruptible sleep: ask again
        await asyncio.sleep(0.001)
    return True


def thaw(group: Path) -> None:
    """Thaw a group (its descendants thaw with it unless frozen themselves)."""
    write(group / "freezer.state", "THAWED")


class NodeCgroups:
    """The dsec-<node> groups of one node and the sandbox and exec groups below them."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        own = own_paths()
        self.base = {c: p / f"dsec-{node_id}" for c, p in own.items()}
        self.batch = {c: p / f"dsec-{node_id}{BATCH_SUFFIX}" for c, p in own.items()}   # made at its first use
        self._batch_cpu = str(self.batch["cpu"])
        self._has_batch = os.path.isdir(self._batch_cpu)
        self.trees = (self.base, self.batch)

    def setup(self) -> None:
        """Create the node groups (existing ones are kept). The cpuset group takes its parent's cpus and
        memory nodes and hands them to every sandbox group made in it (clone_children): sandboxes get
        the node's cpus, in a cpuset group of their own, which lxcfs needs to size their cpuinfo. The host's
        tables a sandbox could fill are lifted first (lift_host_tables): the node's pids share follows."""
        lift_host_tables()
        self._make(self.base)

    @staticmethod
    def _make(tree: dict[str, Path]) -> None:
        for path in tree.values():
            path.mkdir(exist_ok=True)
        if "pids" in tree:   # what all its sandboxes together hold: the host keeps the rest (helper A2)
            write(tree["pids"] / "pids.max", str(node_tasks()))
        if "cpuset" in tree:
            node = tree["cpuset"]
            for name in ("cpuset.cpus", "cpuset.mems"):
                if not read(node / name).strip():
                    write(node / name, read(node.parent / name).strip())
            write(node / "cgroup.clone_children", "1")   # (inherited by the shards, made next)
        for path in tree.values():
            for i in range(SHARDS):
                (path / f"g{i:02d}").mkdir(exist_ok=True)

    def _make_batch(self) -> None:
        """The batch tree, at the first batch sandbox (a node that runs none pays nothing for it)."""
        if self._has_batch:
            return
        self._make(self.batch)
        cpu = self.batch["cpu"]
        write(cpu / "cpu.shares", str(BATCH_SHARES))
        if (cpu / "cpu.idle").exists():
            write(cpu / "cpu.idle", "1")
        self._has_batch = True

    def sandbox(self, sandbox_id: str, batch: bool | None = None) -> dict[str, Path]:
        """Group directories of one sandbox, per controller. batch: in the batch tree; None: wherever its
        cpu group is (a stat, only once the node has a batch tree)."""
        group = shard(sandbox_id)
        if batch is None:
            batch = self._has_batch and os.path.isdir(f"{self._batch_cpu}/{group}/{sandbox_id}")
            if self._has_batch and not batch and not os.path.isdir(f"{self.base['cpu']}/{group}/{sandbox_id}"):
                # neither cpu group (a teardown cut short removes cpu first): wherever any group is left
                batch = any(os.path.isdir(p / group / sandbox_id) for p in self.batch.values())
        return {c: p / group / sandbox_id for c, p in (self.batch if batch else self.base).items()}

    def exec_group(self, sandbox_id: str, n: int) -> dict[str, Path]:
        """Group directories of one exec of a sandbox, per exec controller."""
        return {c: p / f"x{n}" for c, p in self.sandbox(sandbox_id).items() if c in EXEC_CONTROLLERS}

    def exec_join(self, sandbox_id: str, n: int) -> list[Path]:
        """Every group an exec's process joins: its own where it has one, else the sandbox's."""
        return [p / f"x{n}" if c in EXEC_CONTROLLERS else p for c, p in self.sandbox(sandbox_id).items()]

    def create_sandbox(self, sandbox_id: str, limits: Limits, io_device: str = "") -> dict[str, Path]:
        """Create a sandbox's groups with its limits (I/O on io_device, "major:minor", throttled); on
        failure nothing is left."""
        batch = limits.cpu_class == "batch"
        groups = self.sandbox(sandbox_id, batch)
        try:
            if batch:
                self._make_batch()
            for path in groups.values():
                path.mkdir()
            period = int(read(groups["cpu"] / "cpu.cfs_period_us") or 100000)
            write(groups["cpu"] / "cpu.cfs_quota_us", str(max(1000, int(limits.cpu * period))))
            # memory first: memsw may never be below memory, so with swap = memory it is set second.
            write(groups["memory"] / "memory.limit_in_bytes", str(limits.memory))
            if (groups["memory"] / "memory.memsw.limit_in_bytes").exists():   # absent without swapaccount
                write(groups["memory"] / "memory.memsw.limit_in_bytes", str(limits.memory))
            write(groups["pids"] / "pids.max", str(limits.pids))
            write(groups["devices"] / "devices.deny", "a")
            for rule in DEVICE_RULES:
                write(groups["devices"] / "devices.allow", rule)
            if io_device and "blkio" in groups:
                for name, value in IO_LIMITS:
                    write(groups["blkio"] / name, f"{io_device} {value}")
        except OSError as exc:
            self.remove(groups)
            raise CgroupError(f"cgroup setup for {sandbox_id} failed: {exc}") from exc
        return groups

    async def create_sandbox_off_loop(self, sandbox_id: str, limits: Limits, io_device: str = "") -> dict[str, Path]:
        """create_sandbox in a worker thread: the mkdirs cost 0.2-2 ms of kernel time per sandbox here (a
        memory cgroup's shrinker map, fresh pages), which held the edge's loop. A caller cancelled meanwhile
        leaves nothing: what the thread made is removed when it ends."""
        made = asyncio.get_running_loop().run_in_executor(None, self.create_sandbox, sandbox_id, limits, io_device)
        try:
            return await asyncio.shield(made)
        except asyncio.CancelledError:
            made.add_done_callback(lambda f: f.cancelled() or f.exception() or self.remove(f.result()))
            raise

    def create_exec(self, sandbox_id: str, n: int) -> dict[str, Path]:
        """Create the child groups of one exec (limits are inherited from the sandbox)."""
        groups = self.exec_group(sandbox_id, n)
        try:
            for path in groups.values():
                path.mkdir()
        except OSError as exc:
            self.remove(groups)
            raise CgroupError(f"exec cgroup for {sandbox_id} failed: {exc}") from exc
        return groups

    @staticmethod
    def remove(groups: dict[str, Path]) -> list[str]:
        """Remove groups (and descendants); return what stays because processes are still in it."""
        busy: list[str] = []
        for path in groups.values():
            busy.extend(rmdir_tree(path))
        return busy

    @staticmethod
    def reset_stats(groups: dict[str, Path]) -> None:
        """Start an exec group's CPU and peak-memory counts afresh (a worker's group, reused per call)."""
        for path, name in ((groups["cpuacct"], "cpuacct.usage"), (groups["memory"], "memory.max_usage_in_bytes")):
            fd = os.open(f"{path}/{name}", os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)

    @staticmethod
    def exec_stats(groups: dict[str, Path]) -> tuple[float, int]:
        """CPU seconds and peak memory bytes used by one exec group."""
        usage = read(f"{groups['cpuacct']}/cpuacct.usage").strip()
        peak = read(f"{groups['memory']}/memory.max_usage_in_bytes").strip()
        return (int(usage) / 1e9 if usage else 0.0), (int(peak) if peak else 0)

    @staticmethod
    def limit_events(groups: dict[str, Path]) -> dict[str, int]:
        """How often each limit fired in these groups (this level only, as v1 counts)."""
        counts: dict[str, int] = {}
        for controller, name, key, ours in EVENTS:
            text = read(groups[controller] / name)
            for line in text.splitlines():
                words = line.split()
                if key is None and len(words) == 1:
                    counts[ours] = int(words[0])
                elif len(words) == 2 and words[0] == key:
                    counts[ours] = int(words[1])
        return counts

    async def reconcile(self) -> list[str]:
        """Kill every process left in the node groups, remove them; return what could not be."""
        for tree in self.trees:
            if not await kill_tree(tree["freezer"]):
                return [f"processes survive in {tree['freezer']}"]
            for path in tree.values():
                for pid in procs_under(path):   # only if a process escaped the freezer group
                    _kill(pid)
        return await self.remove_all()

    async def remove_all(self, timeout: float = 5.0) -> list[str]:
        """Remove the node groups, retrying while dead tasks are still being released."""
        deadline = time.monotonic() + timeout
        while True:
            busy = [what for tree in self.trees for what in self.remove(tree)]
            if not busy or time.monotonic() > deadline:
                self._has_batch = os.path.isdir(self._batch_cpu)
                return busy
            await asyncio.sleep(0.01)

    def sandbox_groups(self) -> list[Path]:
        """Every group below the node's but its shards: the sandboxes' (and anything else put there)."""
        out: list[Path] = []
        for path in (p for tree in self.trees for p in tree.values()):
            if path.is_dir():
                for child in path.iterdir():
                    if child.is_dir():
                        shard_dir = child.name.startswith("g") and child.name[1:].isdigit()
                        out.extend([p for p in child.iterdir() if p.is_dir()] if shard_dir else [child])
        return out

    def describe(self) -> list[str]:
        """Node groups and processes still present (for leftovers checks)."""
        out: list[str] = []
        for path in (p for tree in self.trees for p in tree.values()):
            if path.exists():
                out.append(f"cgroup {path}")
                out.extend(f"process {pid} in {path}" for pid in procs_under(path))
        return out

