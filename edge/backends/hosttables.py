"""Host-wide kernel settings a node of sandboxes needs: the tables one sandbox could fill for everyone (open
files, process ids, terminals) lifted to their ceilings and bounded per sandbox instead, the share of the host's
tasks a node's groups may hold, and cgroup2's favordynmods (cgroup attaches without an RCU grace period)."""
from __future__ import annotations

import logging
import os

from edge.backends import kernel

log = logging.getLogger(__name__)

NODE_TASKS_SHARE = 0.3   # of the host's tasks, what each tree of a node's groups may hold (NodeCgroups.setup):
                         # its latency and batch trees together 60%


def favor_dynmods(mountinfo: str = "/proc/self/mountinfo") -> bool:
    """Turn on the cgroup2 mount's favordynmods, unless DSEC_FAVOR_DYNMODS=0; whether it is on.

    Moving a process into a group (every create, exec and call joins several) takes the kernel's
    threadgroup lock for writing, which without favordynmods waits an RCU grace period whenever no
    move happened just before: measured here, the first attach after a pause takes 7.6 ms, against
    0.25 ms with it on. The option is the kernel's, for hosts whose cgroup membership changes often (a
    node of sandboxes); the price is a slightly dearer fork and exit. It is host-wide and, on 6.18
    kernels, stays on until reboot. The cgroup v1 hierarchies share that lock, so the hybrid layout's
    cgroup2 mount is where it is set. A later mount of cgroup2 (lxcfs mounts every hierarchy when it
    starts) sets the mount's flags anew, so it is called after lxcfs starts."""
    if os.environ.get("DSEC_FAVOR_DYNMODS") == "0":
        return False
    try:
        with open(mountinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    for line in lines:
        head, _, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if len(fields) < 5 or len(rest) < 3 or rest[0] != "cgroup2":
            continue
        options = [o for o in rest[2].split(",") if o not in ("rw", "ro")]
        if "favordynmods" in options:
            return True
        try:
            kernel.mount("cgroup2", fields[4], "cgroup2", kernel.MS_REMOUNT, ",".join([*options, "favordynmods"]))
        except OSError as exc:
            log.warning("cgroup2 favordynmods not set (%s): a cgroup attach after a pause waits a grace period", exc)
            return False
        log.info("cgroup2 at %s remounted with favordynmods (cgroup attaches without a grace period)", fields[4])
        return True
    return False


FILE_MAX = (1 << 63) - 1   # fs.file-max's own ceiling (LONG_MAX)
PID_MAX = 1 << 22          # kernel.pid_max's ceiling on 64-bit, systemd's setting at boot (v243 on)
PTY_MAX = 1 << 20          # kernel.pty.max's ceiling (NR_UNIX98_PTY_MAX)
# Host-wide tables a sandbox could fill for everyone, lifted at the edge's start (unless
# DSEC_LIFT_HOST_TABLES=0), each bounded per sandbox instead:
HOST_TABLES = (
    # open files: each is charged to its memory cgroup. At the kernel's default (10% of RAM in KiB: 2.4M
    # on 24 GiB) one sandbox of 2 GiB filled the table, and every process of the host without
    # CAP_SYS_ADMIN failed to open anything (ENFILE): the execs and creates of every other sandbox.
    ("/proc/sys/fs/file-max", FILE_MAX, "open files are bounded by each sandbox's memory limit"),
    # process ids: at the kernel's default (32,768) one sandbox's 24,000 threads took most of them (helper
    # A2); each task's kernel stack is charged to its memory cgroup, and each tree of the node's groups
    # holds at most NODE_TASKS_SHARE of kernel.threads-max (NodeCgroups.setup)
    ("/proc/sys/kernel/pid_max", PID_MAX, "process ids are bounded by kernel.threads-max and each group's pids"),
    # terminals: 3,072 for every devpts instance together at the default (4,096 less the host's reserve
    # of 1,024); one sandbox took them all and no other could open a terminal (helper A2). Each sandbox's
    # devpts holds DEVPTS_MAX (zygote.py)
    ("/proc/sys/kernel/pty/max", PTY_MAX, "terminals are bounded by each sandbox's devpts (max=)"),
)


def _lifting() -> bool:
    return os.environ.get("DSEC_LIFT_HOST_TABLES", os.environ.get("DSEC_LIFT_FILE_MAX")) != "0"


def lift_host_tables() -> list[str]:
    """Lift the host-wide tables of HOST_TABLES to their ceilings (as systemd lifts file-max and pid_max
    at boot); those lifted (or already there)."""
    if not _lifting():
        return []
    done = []
    for path, ceiling, why in HOST_TABLES:
        try:
            with open(path) as f:
                if int(f.read()) < ceiling:
                    with open(path, "w") as f:
                        f.write(str(ceiling))
                    log.info("%s lifted to %d: %s", path, ceiling, why)
            done.append(path)
        except (OSError, ValueError) as exc:
            log.warning("%s not lifted (%s): one sandbox may fill the host's table", path, exc)
    return done


def node_tasks(lifted: bool = False) -> int:
    """The tasks each tree of the node's sandbox groups may hold (NodeCgroups.setup), a share of what the
    host can have (kernel.threads-max and kernel.pid_max as they are; lifted: pid_max as lift_host_tables
    will leave it, for a node not started yet); the rest is the host's."""
    limits = []
    for path in ("/proc/sys/kernel/threads-max", "/proc/sys/kernel/pid_max"):
        try:
            with open(path) as f:
                limits.append(int(f.read()))
        except (OSError, ValueError):
            limits.append(32768)
    if lifted and _lifting():
        limits[1] = max(limits[1], PID_MAX)
    return max(1024, int(min(limits) * NODE_TASKS_SHARE))
