"""Wire messages: frozen msgspec structs, JSON, tagged by `kind`, version field `v` on every one."""
from __future__ import annotations

from typing import Literal, Union

import msgspec

from bus.errors import InvalidRequest
from bus.network import Network

WIRE_VERSION = 1


class Wire(msgspec.Struct, frozen=True, tag_field="kind", forbid_unknown_fields=False):
    """Base of every message on the bus."""

    v: int = WIRE_VERSION


class Resources(msgspec.Struct, frozen=True):
    """Normalised resources: cores and bytes."""

    cpu: float = 1.0
    memory: int = 256 << 20
    pids: int = 256
    disk: int = 256 << 20


class LayerRef(msgspec.Struct, frozen=True):
    """One resolved read-only layer: name, version and content digest."""

    name: str
    version: int
    digest: str
    size: int = 0


# ---- create lane -------------------------------------------------------------------------------

class CreateRequest(Wire, tag="create"):
    """libdsec -> placement -> edge: start a sandbox. request_id is the Nats-Msg-Id."""

    request_id: str = ""
    sandbox_id: str = ""
    tenant: str = "default"
    image: str = "busybox"
    backend: str = "container"
    resources: Resources = Resources()
    ttl: float = 600.0
    env: dict[str, str] = {}
    labels: dict[str, str] = {}
    deadline: float = 0.0            # absolute unix time; passed -> ends as expired
    reply_to: str = ""               # core subject of the requester's inbox
    sent_at: float = 0.0             # unix time the client sent it (for latency figures)
    priority: Literal["latency", "batch"] = "latency"   # latency requests jump ahead of queued batch ones
    burst: bool | None = None        # may run on the cloud pool past the threshold; None: only batch may
    attempt: int = 0                 # bumped when a lost node's queued creates are placed again
    avoid: list[str] = []            # nodes where its environment failed (placed elsewhere when it can be)
    node: str = ""                   # set by placement
    pool: str = ""                   # set by placement when routed to a pool instead of a node
    layers: list[LayerRef] = []      # set by placement: resolved layers, lowest first (base, workspace, toolkit)
    snapshot: str = ""               # start from this snapshot's layers (client.create(from_snapshot=...))
    workspace: str = ""              # name[@version] of a workspace layer over the base image (optional)
    toolkit: str = ""                # name[@version] of a toolkit layer on top (optional)
    privileged: bool = False         # a VM whose commands keep every guest capability (kinds: "privileged")
    memory: bool = False             # start from the snapshot's memory too (its processes run on): only on the
                                     # node that holds it (SnapshotRecord.memory_node), of its kind and size
    network: Network = Network()     # what it may reach (bus/network.py); kinds without "network": none only
    cwd: str = ""                    # set by placement from the image's config: every exec's default cwd...
    user: str = ""                   # ...and user (its env goes under env)...
    command: list[str] = []          # ...and its Entrypoint + Cmd (shown in the record: `dsec run` without one)
    cpu_class: Literal["", "latency", "batch"] = ""   # "": by priority; batch runs at SCHED_IDLE, low cpu shares
    on_timeout: Literal["destroy", "suspend"] = "destroy"   # at its TTL: destroyed, or suspended (resume to go on)

    def effective_cpu_class(self) -> str:
        """Its CPU class: its own, else its priority's."""
        return self.cpu_class or ("batch" if self.priority == "batch" else "latency")

    def may_burst(self) -> bool:
        """Whether this request may be routed to the burst pool (default: batch yes, latency no)."""
        return self.priority == "batch" if self.burst is None else self.burst


class SandboxReady(Wire, tag="ready"):
    """edge -> requester: the sandbox runs."""

    request_id: str = ""
    sandbox_id: str = ""
    node: str = ""


class Queued(Wire, tag="queued"):
    """placement -> requester: nothing has room yet; the request waits in JetStream."""

    request_id: str = ""
    reason: str = ""


class ErrorReply(Wire, tag="error"):
    """Any service -> requester: the request failed; code maps to a DsecError class."""

    request_id: str = ""
    code: str = "internal"
    message: str = ""
    reason: str = ""


CreateReply = Union[SandboxReady, Queued, ErrorReply]


# ---- sandbox op lane (dsec.node.<node>.exec.<tenant>.<sandbox>) -------------------------------

class ExecRequest(Wire, tag="exec"):
    """libdsec -> edge: run a command; output goes to dsec.out.<tenant>.<node>.<sandbox>.<exec_id>."""

    exec_id: str = ""
    sandbox_id: str = ""
    tenant: str = ""                 # set by the node from the lane's subject (whatever a sender put here)
    argv: list[str] = []             # run as is (resolved inside the sandbox)...
    shell: str = ""                  # ...or a script for the edge's trusted shell (never the image's /bin/sh)
    env: dict[str, str] = {}
    cwd: str = ""                    # "": the sandbox's default (its image's WorkingDir, else /)
    user: str = ""                   # "": the sandbox's default (its image's User, else root); name or uid[:gid]
    stdin: bytes = b""
    timeout: float = 30.0
    deadline: float = 0.0
    max_output: int = 16 << 20
    live_stdin: bool = False         # more stdin comes on dsec.in.<node>.<tenant>.<sandbox>.<exec_id> (ExecInput)
    background: bool = False         # the client does not wait for it: the node acks it once started
    pty_rows: int = 0                # > 0: the command runs on a terminal of this size (its stdin, stdout and
    pty_cols: int = 0                # stderr; its output one stream, stdout); resized with ExecResize
    watch: str = ""                  # instead of a command: this directory's changes, a JSON line each on
    recursive: bool = False          # stdout (edge/backends/watcher.py), until signalled or its timeout
    end_on_exit: bool = False        # it ends when its command exits, with what its pipes hold then; a process it
                                     # left running keeps on, its later output not read (E2B's commands.run).
                                     # False: once every holder of its stdout and stderr closed them too


class DestroyRequest(Wire, tag="destroy"):
    """libdsec -> edge: destroy a sandbox."""

    request_id: str = ""
    sandbox_id: str = ""
    reply_to: str = ""
    deadline: float = 0.0


class SuspendRequest(Wire, tag="suspend"):
    """libdsec -> edge: freeze every process of a sandbox (client.suspend)."""

    request_id: str = ""
    sandbox_id: str = ""
    reply_to: str = ""
    deadline: float = 0.0


class ResumeRequest(Wire, tag="resume"):
    """libdsec -> edge: thaw a suspended sandbox (client.resume)."""

    request_id: str = ""
    sandbox_id: str = ""
    reply_to: str = ""
    deadline: float = 0.0


class SnapshotRequest(Wire, tag="snapshot"):
    """libdsec -> edge: pack the sandbox's writable layer as a new layer over its own (sb.snapshot)."""

    request_id: str = ""
    sandbox_id: str = ""
    tag: str = ""
    reply_to: str = ""
    deadline: float = 0.0
    memory: bool = False             # the VM's memory too (kinds: "memory_snapshot"), held on its node


class RollbackRequest(Wire, tag="rollback"):
    """libdsec -> edge: restart a sandbox on a snapshot's layers with a fresh writable layer (sb.rollback)."""

    request_id: str = ""
    sandbox_id: str = ""
    snapshot_id: str = ""
    reply_to: str = ""
    deadline: float = 0.0


class SetNetworkRequest(Wire, tag="set_network"):
    """libdsec -> edge: change a running sandbox's network policy (sb.set_network); answered once the policy
    is in force for every connection it opens after."""

    request_id: str = ""
    sandbox_id: str = ""
    network: Network = Network()
    reply_to: str = ""
    deadline: float = 0.0


class SetTimeoutRequest(Wire, tag="set_timeout"):
    """libdsec -> edge: the sandbox now expires `timeout` seconds from now (shorter or longer; 0: at once).
    A suspended sandbox's count starts again when it is resumed."""

    request_id: str = ""
    sandbox_id: str = ""
    timeout: float = 0.0
    reply_to: str = ""
    deadline: float = 0.0


class ListProcesses(Wire, tag="list_processes"):
    """libdsec -> edge: the sandbox's running execs; answered OkReply(data=bus.execwire.ProcessList)."""

    request_id: str = ""
    sandbox_id: str = ""
    reply_to: str = ""
    deadline: float = 0.0


class WriteFile(Wire, tag="write_file"):
    """libdsec -> edge: write a file inside the sandbox."""

    request_id: str = ""
    sandbox_id: str = ""
    path: str = ""
    data: bytes = b""
    mode: int = 0o644
    reply_to: str = ""
    deadline: float = 0.0


class ReadFile(Wire, tag="read_file"):
    """libdsec -> edge: read a file inside the sandbox."""

    request_id: str = ""
    sandbox_id: str = ""
    path: str = ""
    limit: int = 16 << 20
    reply_to: str = ""
    deadline: float = 0.0


class OkReply(Wire, tag="ok"):
    """edge -> requester: the op succeeded (data for read_file)."""

    request_id: str = ""
    data: bytes = b""


FILE_OPS = ("stat", "list", "mkdir", "remove", "rename", "read", "write")
FILE_PIECE = 512 << 10   # bytes per read or write piece of a file op (a 100 MiB file is 200 requests)


class FileOp(Wire, tag="file_op"):
    """libdsec -> edge: one file-tree operation in the sandbox's root (edge/backends/treeops.py).

    stat/list/mkdir/remove name `path` (list goes `depth` levels down, a page of entries at a time: those
    sorting after `after`, the last path of the page before); rename moves path to `dest`; read
    returns up to `length` bytes from `offset`; write puts `data` at `offset` (0 creates or truncates,
    with `mode`; later pieces must start where the file ends)."""

    request_id: str = ""
    sandbox_id: str = ""
    op: str = "stat"
    path: str = ""
    dest: str = ""
    depth: int = 1
    after: str = ""
    paged: bool = False             # list: the caller follows `next` (an older SDK does not: refused past a page)
    offset: int = 0
    length: int = FILE_PIECE
    data: bytes = b""
    mode: int = 0o644
    metadata: dict[str, str] = {}   # write at offset 0: stored as the file's user.<key> xattrs
    user: str = ""                  # as whom (permissions checked as, owner of what it makes); "": the
    reply_to: str = ""              # sandbox's default user (its image's User, else root)
    deadline: float = 0.0


class FileEntry(msgspec.Struct, frozen=True):
    """One entry of a sandbox's file tree, owners as the sandbox sees them."""

    name: str
    path: str
    type: str               # file, dir, symlink or other
    size: int = 0
    mode: int = 0           # permission bits
    permissions: str = ""   # as ls shows them: rwxr-xr-x
    uid: int = 0
    gid: int = 0
    mtime: float = 0.0
    symlink_target: str = ""
    metadata: dict[str, str] = {}   # its user.* xattrs, "user." taken off


class FileEvent(msgspec.Struct, frozen=True):
    """A change under a watched directory, one JSON line of a watch's output: type create, write, remove,
    rename, chmod (overflow: some were lost; mark: a flush came back, named by it), name relative to the
    directory ("" for the directory itself)."""

    type: str
    name: str = ""


class FileOpResult(msgspec.Struct, frozen=True):
    """What a file op returns (in OkReply.data): the fields its op fills."""

    entry: FileEntry | None = None
    entries: list[FileEntry] = []
    next: str = ""                  # list: more entries follow; ask again with after=next
    made: bool = False
    data: bytes = b""
    size: int = 0


SandboxOp = Union[ExecRequest, DestroyRequest, WriteFile, ReadFile, SuspendRequest, ResumeRequest, SnapshotRequest,
                  RollbackRequest, SetNetworkRequest, FileOp, SetTimeoutRequest, ListProcesses]
OpReply = Union[OkReply, ErrorReply]


def encode(msg: msgspec.Struct) -> bytes:
    """Encode any wire message (or a struct carried in one) to JSON; InvalidRequest for a string that is no
    text (a lone surrogate: a name Python decoded with surrogateescape), which raised UnicodeEncodeError."""
    try:
        return _ENCODER.encode(msg)
    except UnicodeEncodeError as exc:
        bad = exc.object[max(0, exc.start - 40):exc.end + 20] if isinstance(exc.object, str) else ""
        raise InvalidRequest(f"{type(msg).__name__}: a string is not valid UTF-8 text ({bad!r}): the wire carries "
                             f"text, and names that are not UTF-8 bytes cannot be given") from None


_ENCODER = msgspec.json.Encoder()

# One typed decoder per family, built once.
create_decoder = msgspec.json.Decoder(CreateRequest)
create_reply_decoder = msgspec.json.Decoder(CreateReply)
op_decoder = msgspec.json.Decoder(SandboxOp)
op_reply_decoder = msgspec.json.Decoder(OpReply)
file_result_decoder = msgspec.json.Decoder(FileOpResult)
file_event_decoder = msgspec.json.Decoder(FileEvent)


class _Envelope(msgspec.Struct):
    """Lenient view of a malformed request: just enough to answer it."""

    request_id: str = ""
    exec_id: str = ""
    sandbox_id: str = ""
    reply_to: str = ""


_envelope_decoder = msgspec.json.Decoder(_Envelope)


def salvage(data: bytes) -> _Envelope:
    """Best-effort read of who to answer for a message that failed to decode."""
    try:
        return _envelope_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _Envelope()
