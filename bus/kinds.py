"""Backend kinds: the names, what each can do (capabilities) and what each sandbox of it costs beyond
what it asks for (overhead). The one table the SDK, placement and the edges share, so an operation a
kind lacks is refused before anything starts, and every side books the same amount.

Capabilities:
  exec        run a command in a sandbox (argv or a trusted-shell script)
  stream      its output as it is produced (exec handles, dsec.out records)
  live_stdin  write to a running command's stdin, send it signals
  files       write_file / read_file (for fncall: files given with the call and read back after it)
  snapshot    pack the writable layer into a layer and start sandboxes from it (fork is a snapshot's use)
  fork        start sandboxes from a running one's snapshot
  suspend     freeze a sandbox's processes and thaw them later
  network     a network policy (Aether)
  users       commands as a non-root user of the image (exec(user=...), an imported image's User)
  warm_pools  keep ready sandboxes to claim
  call        stateless function calls (client.call), no sandbox id
  privileged  create(privileged=True): commands keep every capability of a guest kernel of their own, whose
              only promise is that the host and other sandboxes are untouched (VM kinds only)
  pty         commands on a terminal of the sandbox's own devpts (sb.terminal), resized while they run
  watch       files.watch: a directory's changes streamed as they happen (inotify, from the edge)
  memory_snapshot  snapshot(memory=True): the VM's RAM and device state too, so its forks go on from the
              same instant, processes running (they run on the node holding it: docs/backends.md)
"""
from __future__ import annotations

from bus.errors import InvalidRequest, Unsupported

CONTAINER, FNCALL, GVISOR, MICROVM, FULLVM, NOOP = "container", "fncall", "gvisor", "microvm", "fullvm", "noop"
KINDS = (CONTAINER, FNCALL, GVISOR, MICROVM, FULLVM, NOOP)
SERVED = (CONTAINER, FNCALL, GVISOR, MICROVM, FULLVM)   # what `dsec up` may run; noop is for tests/benchmarks

CAPABILITIES: dict[str, frozenset[str]] = {
    CONTAINER: frozenset({"exec", "stream", "live_stdin", "files", "snapshot", "fork", "suspend", "warm_pools",
                          "network", "users", "file_tree", "watch", "pty"}),
    GVISOR: frozenset({"exec", "stream", "live_stdin", "files", "suspend", "warm_pools", "network", "file_tree",
                       "watch", "users", "pty"}),
    FNCALL: frozenset({"call", "files"}),
    MICROVM: frozenset({"exec", "stream", "live_stdin", "files", "snapshot", "fork", "suspend", "warm_pools",
                        "privileged", "memory_snapshot", "network", "file_tree", "watch", "users",
                        "pty"}),
    FULLVM: frozenset({"exec", "stream", "live_stdin", "files", "snapshot", "fork", "suspend", "warm_pools",
                       "privileged", "memory_snapshot", "network", "file_tree", "watch", "users",
                       "pty"}),
    NOOP: frozenset({"exec", "stream", "files", "suspend"}),
}

# Per-sandbox cost on top of the request, (memory bytes, disk bytes): a node's memory and disk are shared
# by every kind it runs, so a node full of containers has no room left for a VM.
OVERHEAD: dict[str, tuple[int, int]] = {
    CONTAINER: (2 << 20, 0),
    GVISOR: (24 << 20, 0),        # sentry + gofer of an idle sandbox (~20 MiB PSS measured)
    FNCALL: (0, 0),               # workers are the node's, booked by its fncall slots
    MICROVM: (96 << 20, 0),       # QEMU's own RSS beside the guest's memory
    FULLVM: (160 << 20, 0),
    NOOP: (0, 0),
}

# The least memory a sandbox of a kind boots with (the guest kernel and its initramfs need it).
# A full VM's Debian (systemd, journald) holds ~40 MiB of its 256 beside the kernel's.
MIN_MEMORY: dict[str, int] = {MICROVM: 128 << 20, FULLVM: 256 << 20}
# The fewest processes a sandbox of a kind boots with: a VM's guest agent forks beside each command (with one,
# its template never came up, and the create failed as an environment failure, to be retried elsewhere in vain).
MIN_PIDS: dict[str, int] = {MICROVM: 2, FULLVM: 2}
# The least writable disk of a kind: a VM's is an ext4 image of its own (below this it was enlarged unasked).
MIN_DISK: dict[str, int] = {MICROVM: 16 << 20, FULLVM: 16 << 20}


def check_kind(kind: str) -> str:
    """The kind, or InvalidRequest naming the kinds that exist."""
    if kind not in KINDS:
        raise InvalidRequest(f"backend must be one of {', '.join(SERVED)}, got {kind!r}")   # (noop: tests' own)
    return kind


def supports(kind: str, capability: str) -> bool:
    """Whether sandboxes of this kind offer the capability."""
    return capability in CAPABILITIES.get(kind, frozenset())


def require(kind: str, capability: str, operation: str = "") -> None:
    """Unsupported (naming the kind and the operation) when the kind lacks the capability."""
    if not supports(kind, capability):
        raise Unsupported(f"backend {kind!r} does not support {operation or capability} "
                          f"(it offers: {', '.join(sorted(CAPABILITIES.get(kind, ()))) or 'nothing'})",
                          backend=kind, operation=operation or capability)


ROOT_NAMES = ("", "root", "0", "0:0", "root:root")   # users that are a sandbox's root (every kind has it)


def require_user(kind: str, user: str | None, operation: str) -> None:
    """Unsupported when user names someone besides the sandbox's root and the kind lacks "users"."""
    if user is not None and user not in ROOT_NAMES:
        require(kind, "users", f"{operation} as user {user!r}")


def booked(kind: str, r):
    """What a sandbox of this kind takes from its node: the request plus the kind's overhead."""
    import msgspec
    memory, disk = OVERHEAD.get(kind, (0, 0))
    return msgspec.structs.replace(r, memory=r.memory + memory, disk=r.disk + disk) if memory or disk else r


def check_create_kind(kind: str, from_snapshot: bool = False, privileged: bool = False,
                      network: bool = False) -> None:
    """A create of this kind is possible: the kind exists (InvalidRequest), has sandboxes (fncall has
    calls instead) and, from a snapshot, can fork, privileged, is a VM, and with a network policy other than
    none, has a network (Unsupported)."""
    check_kind(kind)
    if privileged:
        require(kind, "privileged", "privileged sandboxes")
    if network:
        require(kind, "network", "network policies other than none")
    if not supports(kind, "exec"):
        raise Unsupported(f"backend {kind!r} has no sandboxes to create: use client.call()",
                          backend=kind, operation="create")
    if from_snapshot:
        require(kind, "fork", "create from a snapshot")
