"""Subject names: the one place that spells them."""
from __future__ import annotations

import hashlib
import re

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def token(value: str, what: str) -> str:
    """Return value if it is a safe single subject token, else raise ValueError naming `what`."""
    if not isinstance(value, str) or not _TOKEN.match(value):
        raise ValueError(f"{what} must be 1-128 characters of [A-Za-z0-9_-], got {value!r}")
    return value


_REPLY = re.compile(r"^(_INBOX|dsec\.reply\.[A-Za-z0-9_-]{1,128})\.[A-Za-z0-9_.-]{1,200}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


def is_token(value: str) -> bool:
    """Whether value can be one subject token (an id, a KV key)."""
    return isinstance(value, str) and bool(_TOKEN.match(value))


def is_reply_subject(subject: str) -> bool:
    """Replies go only to inboxes (a tenant's dsec.reply.<tenant>.>, or a core _INBOX): a request can never
    make a service publish on a system subject."""
    return isinstance(subject, str) and bool(_REPLY.match(subject))


def replies(tenant: str) -> str:
    """The prefix of a tenant's reply subjects: where the platform answers its creates, ops and calls (a
    subject space a server permission can give to that tenant alone)."""
    return f"dsec.reply.{tenant}"


def reply_tenant(subject: str) -> str:
    """The tenant whose reply space a reply subject is in ("" for a core _INBOX or anything else)."""
    parts = subject.split(".") if isinstance(subject, str) else []
    return parts[2] if len(parts) > 3 and parts[0] == "dsec" and parts[1] == "reply" else ""


def is_digest(value: str) -> bool:
    """A layer digest as the store names it: sha256:<64 hex>."""
    return bool(_DIGEST.match(value))


PRIORITIES = ("latency", "batch")


def create_request(tenant: str, priority: str = "latency") -> str:
    """Where libdsec sends a CreateRequest: one subject per priority, so latency requests never queue
    behind batch ones."""
    return f"dsec.req.create.{priority}.{tenant}"


def create_requests(priority: str) -> str:
    """Filter of one priority's create requests (one placement consumer each)."""
    return f"dsec.req.create.{priority}.*"


def call_request(tenant: str, priority: str = "latency") -> str:
    """Where libdsec sends a CallRequest (fncall): one work-queue subject per priority and tenant, pulled
    by every node with free workers (competing consumers: no placement round trip per call)."""
    return f"dsec.call.{priority}.{tenant}"


def call_requests(priority: str) -> str:
    """Filter of one priority's calls (one consumer each, shared by the fncall nodes)."""
    return f"dsec.call.{priority}.*"


def api(tenant: str, verb: str) -> str:
    """The control API (core request/reply, served by the placement engines): reads and settings of one
    tenant, which the server learns from this subject, never from the payload (bus/apiwire.py)."""
    return f"dsec.api.{tenant}.{verb}"


def api_all() -> str:
    return "dsec.api.*.*"


def pool_create(pool: str) -> str:
    """Where placement routes a create for any edge of a pool (cloud bursting); the pool's edges compete."""
    return f"dsec.pool.{pool}.create"


def node_create(node: str) -> str:
    """Where placement sends a placed CreateRequest for one node."""
    return f"dsec.node.{node}.create"


def node_ops(node: str, tenant: str = "*", sandbox: str = "*") -> str:
    """Where libdsec sends ops (exec, destroy, files) for a sandbox on a node. The tenant token is whose
    sandbox it must be: the node refuses an op whose sandbox is another tenant's (as never existing)."""
    return f"dsec.node.{node}.exec.{tenant}.{sandbox}"


def node_ops_all(node: str) -> str:
    """Filter of one node's op lane."""
    return f"dsec.node.{node}.exec.>"


def op_target(subject: str) -> tuple[str, str] | None:
    """(tenant, sandbox) of an op lane subject; None when it is not one. A subject of before the tenant
    token (dsec.node.<node>.exec.<sandbox>, still on a lane at an upgrade) gives tenant ""."""
    parts = subject.split(".")
    if len(parts) == 6 and parts[3] == "exec":
        return parts[4], parts[5]
    if len(parts) == 5 and parts[3] == "exec":
        return "", parts[4]
    return None


def exec_input(node: str, tenant: str = "*", sandbox: str = "*", exec_id: str = "*") -> str:
    """Core request/reply to a running exec on its node: live stdin and signals (no stream keeps them)."""
    return f"dsec.in.{node}.{tenant}.{sandbox}.{exec_id}"


def output(tenant: str, node: str, sandbox: str, exec_id: str = "*") -> str:
    """Where an exec's output records go: the tenant and node tokens are what a server permission scopes
    on (a tenant reads only its own; a node publishes only its own)."""
    return f"dsec.out.{tenant}.{node}.{sandbox}.{exec_id}"


def heartbeat(node: str = "*") -> str:
    """A node's core heartbeats (every engine listens: liveness that needs no JetStream leader)."""
    return f"dsec.hb.{node}"


def engine_probe(engine: str) -> str:
    """Where a placement engine hears itself: its own connection works (it may judge others' silence)."""
    return f"dsec.probe.{engine}"


def layer_dropped() -> str:
    """Where placement says a snapshot's layer was deleted (its digest): every edge drops its cached copy."""
    return "dsec.layers.dropped"


def event(tenant: str, sandbox: str) -> str:
    """Lifecycle events of one sandbox."""
    return f"dsec.evt.{tenant}.{sandbox}"


def trajectory(tenant: str, job: str, sandbox: str) -> str:
    """One sandbox's trajectory timeline (every exec and lifecycle record, in order)."""
    return f"dsec.traj.{tenant}.{job}.{sandbox}"


PROJECT_SEP = "__"   # an IAM project's account: <tenant>__<project> (no tenant or project name holds "__")


def project_account(tenant: str, project: str) -> str:
    """The account (and subject token) of a project under a tenant: the server scopes it as any tenant."""
    return f"{tenant}{PROJECT_SEP}{project}"


def account_name(name: str) -> str:
    """A tenant or project as a user writes it (`acme`, `acme/p1`) as its account name (`acme`, `acme__p1`)."""
    return project_account(*name.split("/", 1)) if "/" in name else name


def tenant_root(account: str) -> str:
    """The tenant an account belongs to: itself, or the tenant a project account is under."""
    return account.split(PROJECT_SEP, 1)[0]


def sees(viewer: str, owner: str) -> bool:
    """Whether an account sees another's records: its own, and a tenant its projects'."""
    return owner == viewer or (PROJECT_SEP not in viewer and owner.startswith(viewer + PROJECT_SEP))


def display_name(account: str) -> str:
    """An account as a user writes it: `acme`, or `acme/p1` for a project."""
    return account.replace(PROJECT_SEP, "/", 1)


def describe(account: str) -> str:
    """An account named for a message: `tenant acme`, `project acme/p1`."""
    return f"{'project' if PROJECT_SEP in account else 'tenant'} {display_name(account)}"


def record_key(tenant: str, id_: str) -> str:
    """A sandbox's key in KV dsec-sandboxes, or a snapshot's in dsec-snapshots: <tenant>.<id>, so a reader
    (and a server permission) can take one tenant's records by subject, $KV.<bucket>.<tenant>.>. A
    project's are <tenant>.<project>.<id>: under its tenant's, so the tenant's read takes them too."""
    return f"{record_prefix(tenant)}.{id_}"


def record_prefix(tenant: str) -> str:
    """The key prefix of one account's records (a tenant's takes its projects' too)."""
    return tenant.replace(PROJECT_SEP, ".", 1)


def job_of(labels: dict[str, str]) -> str:
    """The job a sandbox belongs to: its `job` label as a subject token (job_token), `default` without one."""
    return job_token(labels.get("job", "")) or "default"


def job_token(job: str) -> str:
    """A job name as its trajectory subject's token: itself when it is one; else each character outside
    [A-Za-z0-9_-] made `_`, with a hash of the whole name after it (`run.42` -> `run_42-1c2b9a4e`), so names
    that differ stay apart. Readers given the name find the same token."""
    if not isinstance(job, str) or not job or _TOKEN.match(job):
        return job if isinstance(job, str) else ""
    digest = hashlib.sha256(job.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return re.sub(r"[^A-Za-z0-9_-]", "_", job)[:100] + "-" + digest
