"""The control API's wire messages: libdsec -> `dsec.api.<tenant>.<verb>` (core request/reply, served by every
placement engine in one queue group) -> one reply. The tenant is the subject's token, never a payload field.

Creates and sandbox ops do not go through here: they stay on their work-queue lanes (DSEC_REQ, DSEC_NODE),
where JetStream acks, de-duplicates and keeps them. These are the reads and the settings around them, and
the reads of what streams keep for a tenant (an exec's stored output, its trajectory records): a tenant
account has no JetStream rights of its own in DSEC."""
from __future__ import annotations

from typing import Union

import msgspec

from bus.messages import ErrorReply, Wire
from bus.records import Quota, SandboxRecord, SnapshotRecord, WarmPool

MAX_PAGE = 500             # records per reply (a reply stays well under the server's 1 MiB max payload)


class GetSandbox(Wire, tag="get_sandbox"):
    """The record of one of the caller's sandboxes (any state); SandboxNotFound when there is none."""

    sandbox_id: str = ""


class ListSandboxes(Wire, tag="list_sandboxes"):
    """The caller's sandbox records by id, filtered on the server: `states` (empty: every state), every
    label in `labels`; at most `limit` (and about 768 KiB) per page, `next_token` from the previous page."""

    states: list[str] = []
    labels: dict[str, str] = {}
    limit: int = MAX_PAGE
    next_token: str = ""


class SandboxPage(Wire, tag="sandbox_page"):
    """One page of records; `next_token` is empty on the last page."""

    records: list[SandboxRecord] = []
    next_token: str = ""


class GetSnapshot(Wire, tag="get_snapshot"):
    """One of the caller's snapshots by id, or the newest with this tag; ImageNotFound when none."""

    ref: str = ""


class ListSnapshots(Wire, tag="list_snapshots"):
    """The caller's snapshots, oldest first (only those with `tag` when given)."""

    tag: str = ""


class DeleteSnapshot(Wire, tag="delete_snapshot"):
    """Delete one of the caller's snapshots (refused while another is built on it or a sandbox uses it)."""

    ref: str = ""


class SnapshotList(Wire, tag="snapshot_list"):
    snapshots: list[SnapshotRecord] = []


class SetWarmPool(Wire, tag="set_warm_pool"):
    """Create or change one of the caller's warm pools (a name another tenant holds is refused)."""

    pool: WarmPool = WarmPool()


class ListWarmPools(Wire, tag="list_warm_pools"):
    """The caller's warm pools with their ready sandboxes per node."""


class DeleteWarmPool(Wire, tag="delete_warm_pool"):
    name: str = ""


class WarmPoolState(msgspec.Struct, frozen=True):
    spec: WarmPool
    ready: dict[str, int] = {}       # node -> ready warm sandboxes
    error: str = ""                  # why its layers do not resolve now, if they do not


class WarmPoolList(Wire, tag="warm_pool_list"):
    pools: list[WarmPoolState] = []


class GetQuota(Wire, tag="get_quota"):
    """The caller's quota and what it holds now."""


class QuotaState(Wire, tag="quota_state"):
    """A tenant's limits (0: none) and what its live sandboxes (starting or ready) hold."""

    quota: Quota = Quota()
    sandboxes: int = 0
    cpu: float = 0.0
    memory: int = 0


class GetBackends(Wire, tag="get_backends"):
    """The backend kinds some live node offers now (a call needs one running fncall workers)."""


class Backends(Wire, tag="backends"):
    kinds: list[str] = []
    known: bool = True   # False: the engine has not read the node records yet (an engine just started)


class ReadOutput(Wire, tag="read_output"):
    """Stored records of one of the caller's execs (DSEC_OUT): the first after stream seq `after` (and with
    `batch` > 1 up to that many in all, the rest in the reply's `more`), or with `last` the last one; `found`
    False in the reply when there is none."""

    node: str = ""
    sandbox_id: str = ""
    exec_id: str = ""
    after: int = 0
    last: bool = False
    batch: int = 1


class StoredPiece(Wire, tag="stored_piece"):
    seq: int = 0
    data: bytes = b""
    headers: dict[str, str] = {}


class StoredOutput(Wire, tag="stored_output"):
    found: bool = False
    seq: int = 0
    data: bytes = b""
    headers: dict[str, str] = {}
    more: list[StoredPiece] = []   # the records after this one (ReadOutput.batch), in order


class FetchTrajectories(Wire, tag="fetch_trajectories"):
    """A batch of the caller's trajectory records from its reader `reader` (a consumer the server keeps
    for it: `durable` ones resume after any restart, others are dropped a minute after their last read).
    The first fetch sets where it starts (`since_seq` or `since_time`) and what it takes (job, sandbox)."""

    reader: str = ""
    durable: bool = False
    job: str = ""
    sandbox_id: str = ""
    since_seq: int = 0
    since_time: float = 0.0
    ack_wait: float = 30.0
    batch: int = 256
    wait: float = 1.0


class PulledRecord(msgspec.Struct, frozen=True):
    seq: int
    at: float
    data: bytes
    ack: str          # the token AckTrajectories takes back


class TrajectoryBatch(Wire, tag="trajectory_batch"):
    records: list[PulledRecord] = []
    pending: int = 0       # records still after the last one
    ack_pending: int = 0   # records handed out and not acked (any reader of this consumer)


class AckTrajectories(Wire, tag="ack_trajectories"):
    reader: str = ""
    acks: list[str] = []
    naks: list[str] = []     # records fetched and not processed: due again at once


class CloseTrajectories(Wire, tag="close_trajectories"):
    """Drop a reader now (with its position; one that is not durable would go a minute later anyway)."""

    reader: str = ""


class Done(Wire, tag="done"):
    """A request that changed something and returns nothing."""


ApiRequest = Union[GetSandbox, ListSandboxes, GetSnapshot, ListSnapshots, DeleteSnapshot, SetWarmPool,
                   ListWarmPools, DeleteWarmPool, GetQuota, GetBackends, ReadOutput, FetchTrajectories,
                   AckTrajectories, CloseTrajectories]

# verb (the subject's last token) -> the one request type it takes
VERBS: dict[str, type] = {
    "sandbox-get": GetSandbox, "sandbox-list": ListSandboxes,
    "snapshot-get": GetSnapshot, "snapshot-list": ListSnapshots, "snapshot-delete": DeleteSnapshot,
    "pool-set": SetWarmPool, "pool-list": ListWarmPools, "pool-delete": DeleteWarmPool,
    "quota-get": GetQuota, "backends-get": GetBackends,
    "output-read": ReadOutput,
    "traj-fetch": FetchTrajectories, "traj-ack": AckTrajectories, "traj-close": CloseTrajectories,
}
VERB_OF = {cls: verb for verb, cls in VERBS.items()}

api_request_decoder = msgspec.json.Decoder(ApiRequest)
api_reply_decoder = msgspec.json.Decoder(Union[SandboxRecord, SandboxPage, SnapshotRecord, SnapshotList,
                                               WarmPool, WarmPoolList, QuotaState, Backends, StoredOutput,
                                               TrajectoryBatch, Done, ErrorReply])
