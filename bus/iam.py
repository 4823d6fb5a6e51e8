"""Identities on the bus: NATS accounts and nkey users, rendered into the server's configuration.

The model (config-file accounts with nkey users; keys minted with the `nkeys` package, never a signature
scheme of ours):
- account DSEC owns every stream, KV bucket and object store; its users are the platform's principals:
  `admin` (everything), `placement` (everything: it provisions and serves the control API), `ops` (reads,
  replays and watches; no publish, delete or purge) and one `edge-<node>` per node (its own lanes, its
  own node record, output on its own node's subjects);
- one account per tenant, named as the tenant, with no JetStream of its own and no rights in DSEC but
  what DSEC exports to it. Every export carries the importer's account in a subject token
  (`account_token_position`), so the server itself refuses tenant B an import of tenant A's subjects and
  the platform learns the tenant from the subject, never from the payload;
- one account per IAM project under a tenant, named `<tenant>__<project>`: scoped by the server as a
  tenant is, its sandbox records keyed under its tenant's (`<tenant>.<project>.<id>`), so the tenant's
  own credential lists them, and its quota counted against its tenant's too (placement/quota.py).

The state is `<state>/iam/iam.json` (public keys only); each credential's seed is a `.creds` file under
`<state>/creds/` (mode 0600) that only its holder should keep. Revoking removes the user and reloads the
server (bus/iamserver.py), which closes the user's open connections and refuses its next ones.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bus import creds, streams, subjects
from bus.errors import DsecError, InvalidRequest

PLATFORM_ACCOUNT = "DSEC"
RESERVED = {PLATFORM_ACCOUNT, "SYS", "$G", "$SYS", "GLOBAL"}
# a tenant, project or node name: no "__" (it joins a project to its tenant) and no "_" at the end
_NAME = re.compile(r"^(?=.{1,63}$)[a-z0-9](?:[a-z0-9-]|_(?=[a-z0-9-]))*$")
ROLES = ("admin", "placement", "ops")   # and edge-<node>, and tenants

# What a tenant account imports from DSEC: (kind, export subject, token position of the account, import
# subject with {t} for the tenant). Services are requests into DSEC (JetStream lanes answer with the
# stream's ack, the control API and stdin with their reply); streams are what DSEC delivers to it.
EXPORTS = (
    ("service", "dsec.api.*.*", 3, "dsec.api.{t}.*"),
    ("service", "dsec.req.create.*.*", 5, "dsec.req.create.*.{t}"),
    ("service", "dsec.call.*.*", 4, "dsec.call.*.{t}"),
    ("service", "dsec.node.*.exec.*.*", 5, "dsec.node.*.exec.{t}.*"),
    ("service", "dsec.in.*.*.*.*", 4, "dsec.in.*.{t}.*.*"),
    ("stream", "dsec.out.*.>", 3, "dsec.out.{t}.>"),
    ("stream", "dsec.evt.*.>", 3, "dsec.evt.{t}.>"),
    ("stream", "dsec.reply.*.>", 3, "dsec.reply.{t}.>"),
)

# JetStream API requests that change or remove streams and their messages: refused to every principal
# but admin and placement (the server checks the subject: no payload can widen it).
_JS_ADMIN = ["$JS.API.STREAM.CREATE.>", "$JS.API.STREAM.UPDATE.>", "$JS.API.STREAM.DELETE.>",
             "$JS.API.STREAM.PURGE.>", "$JS.API.STREAM.MSG.DELETE.>", "$JS.API.STREAM.RESTORE.>",
             "$JS.API.STREAM.SNAPSHOT.>", "$JS.API.STREAM.PEER.>", "$JS.API.STREAM.LEADER.>",
             "$JS.API.META.>", "$JS.API.SERVER.>", "$JS.API.ACCOUNT.>"]


# Consuming a work queue removes what it acks: ops may read every stream but these.
_WORK_QUEUES = [f"{api}.{s}{tail}" for s in (streams.REQ_STREAM, streams.NODE_STREAM, streams.CALL_STREAM)
                for api, tail in (("$JS.API.CONSUMER.CREATE", ""), ("$JS.API.CONSUMER.CREATE", ".>"),
                                  ("$JS.API.CONSUMER.DURABLE.CREATE", ".>"), ("$JS.API.CONSUMER.MSG.NEXT", ".>"),
                                  ("$JS.ACK", ".>"))]


def principal_name(principal: str) -> str:
    """A principal as the model keys it: `project:acme/p1` and `tenant:acme/p1` are `tenant:acme__p1`."""
    for kind in ("project:", "tenant:"):
        if principal.startswith(kind):
            return "tenant:" + subjects.account_name(principal[len(kind):])
    return principal


class IamError(DsecError):
    """An IAM change was refused (unknown or duplicate name, live sandboxes without --force, ...)."""

    code = "iam"


def check_name(name: str, what: str = "tenant") -> str:
    """A tenant, project or node name: an account name and a subject token at once."""
    if not isinstance(name, str) or not _NAME.match(name) or name.upper() in RESERVED:
        raise InvalidRequest(f"{what} name must be 1-63 characters of [a-z0-9_-] starting with a letter or "
                             f"digit, with no '__' and no '_' at the end, and not {', '.join(sorted(RESERVED))}; "
                             f"got {name!r}")
    return name


def new_seed() -> tuple[bytes, str]:
    """A fresh user key pair: (seed, public key), from the nkeys package."""
    import nkeys
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return seed, nkeys.from_seed(bytearray(seed)).public_key.decode()


def creds_text(seed: bytes, who: str, expires: float = 0.0) -> str:
    """A credential file: the user's nkey seed, decorated as nsc decorates one (and its expiry, if any)."""
    return (f"# DSec credential for {who}. Keep it secret: it is the identity.\n"
            + (creds.expires_line(expires) if expires else "")
            + f"-----BEGIN USER NKEY SEED-----\n{seed.decode()}\n------END USER NKEY SEED------\n")


@dataclass
class Tenant:
    """A tenant's account, or a project's (`<tenant>__<project>`, `parent` naming its tenant)."""

    users: dict[str, str] = field(default_factory=dict)   # user name -> public key
    rate: float = 0.0     # control API requests/s (0: the default), mirrored into the quota record
    parent: str = ""      # the tenant a project is under ("" for a tenant)


@dataclass
class Iam:
    """The identities of one DSec installation (its state dir)."""

    root: Path
    platform: dict[str, str] = field(default_factory=dict)   # admin/placement/ops/edge-<node> -> public key
    tenants: dict[str, Tenant] = field(default_factory=dict)
    pools: dict[str, str] = field(default_factory=dict)   # node -> the pool its edge serves (default local)
    expires: dict[str, float] = field(default_factory=dict)   # principal -> when its credential stops working

    @property
    def path(self) -> Path:
        return self.root / "iam" / "iam.json"

    @property
    def conf_path(self) -> Path:
        return self.root / "iam" / "accounts.conf"

    @classmethod
    def load(cls, root: Path) -> "Iam":
        iam = cls(Path(root).resolve())
        if iam.path.exists():
            data = json.loads(iam.path.read_text())
            iam.platform = dict(data.get("platform", {}))
            iam.pools = dict(data.get("pools", {}))
            iam.expires = {k: float(v) for k, v in data.get("expires", {}).items()}
            iam.tenants = {n: Tenant(dict(t.get("users", {})), float(t.get("rate", 0.0)), t.get("parent", ""))
                           for n, t in data.get("tenants", {}).items()}
        return iam

    @property
    def exists(self) -> bool:
        return self.path.exists()

    def save(self) -> None:
        """iam.json and the accounts.conf rendered from it, under the state dir's lock."""
        data = {"version": 1, "platform": self.platform, "pools": self.pools, "expires": self.expires,
                "tenants": {n: {"users": t.users, "rate": t.rate, **({"parent": t.parent} if t.parent else {})}
                            for n, t in sorted(self.tenants.items())}}
        with state_lock(self.root):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data, indent=2))
            tmp.replace(self.path)
            self.write_conf()

    # ---- credentials --------------------------------------------------------------------------

    def creds_path(self, principal: str) -> Path:
        """Where a principal's credential is written: creds/<role>.creds, creds/tenants/<tenant>.creds."""
        return creds.creds_path(self.root, principal)

    def _mint(self, principal: str, ttl: float = 0.0) -> tuple[str, Path]:
        """A new key pair written as the principal's credential; with ttl (seconds) it expires: the server
        stops accepting it then (its user leaves the rendered configuration, see bus/iamserver.py sweep)."""
        if ttl < 0:
            raise InvalidRequest(f"ttl must be positive seconds, got {ttl}")
        seed, public = new_seed()
        path = self.creds_path(principal)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        at = round(time.time() + ttl) if ttl else 0.0
        with os.fdopen(fd, "w") as f:
            f.write(creds_text(seed, principal, at))
        tmp.replace(path)
        if at:
            self.expires[principal] = at
        else:
            self.expires.pop(principal, None)
        return public, path

    def live(self, principal: str) -> bool:
        """Whether a principal's credential has not expired."""
        return not (0 < self.expires.get(principal, 0.0) <= time.time())

    def issue_platform(self, role: str, ttl: float = 0.0) -> Path:
        """Mint (or mint anew, revoking the old key) a platform principal's credential."""
        if role not in ROLES and not (role.startswith("edge-") and check_name(role[5:], "node")):
            raise InvalidRequest(f"platform role must be one of {', '.join(ROLES)} or edge-<node>, got {role!r}")
        public, path = self._mint(role, ttl)
        self.platform[role] = public
        return path

    def add_tenant(self, name: str, rate: float = 0.0, ttl: float = 0.0) -> Path:
        check_name(name)
        if name in self.tenants:
            raise IamError(f"tenant {name!r} exists already")
        self.tenants[name] = Tenant(rate=rate)
        return self.issue_tenant(name, ttl)

    def add_project(self, tenant: str, project: str, rate: float = 0.0, ttl: float = 0.0) -> Path:
        """A project under a tenant: an account of its own (`<tenant>__<project>`), so the server scopes it
        as it scopes a tenant; its sandboxes count against its own quota and its tenant's."""
        if self.tenant(tenant).parent:
            raise IamError(f"{tenant!r} is a project: projects are made under a tenant")
        account = subjects.project_account(tenant, check_name(project, "project"))
        if account in self.tenants:
            raise IamError(f"project {tenant}/{project} exists already")
        self.tenants[account] = Tenant(rate=rate, parent=tenant)
        return self.issue_tenant(account, ttl)

    def projects(self, tenant: str) -> list[str]:
        """The accounts of a tenant's projects."""
        return sorted(a for a, t in self.tenants.items() if t.parent == tenant)

    def issue_tenant(self, name: str, ttl: float = 0.0) -> Path:
        """A new credential for a tenant or project; its earlier one stops working (at the next reload)."""
        account = subjects.account_name(name)
        tenant = self.tenant(account)
        public, path = self._mint(f"tenant:{account}", ttl)
        tenant.users = {account: public}
        return path

    def revoke(self, principal: str) -> None:
        """Remove a credential: a tenant's or project's (`tenant:<name>`, `project:<tenant>/<project>`) or a
        platform role's."""
        principal = principal_name(principal)
        if principal.startswith("tenant:"):
            self.tenant(principal[7:]).users.clear()
        elif principal in self.platform:
            del self.platform[principal]
        else:
            raise IamError(f"no credential {principal!r} (see `dsec iam ls`)")
        self.expires.pop(principal, None)
        self.creds_path(principal).unlink(missing_ok=True)

    def remove_tenant(self, name: str) -> None:
        """Remove a tenant (with its projects) or one project."""
        account = subjects.account_name(name)
        self.tenant(account)
        for gone in (*self.projects(account), account):
            del self.tenants[gone]
            self.expires.pop(f"tenant:{gone}", None)
            self.creds_path(f"tenant:{gone}").unlink(missing_ok=True)

    def tenant(self, name: str) -> Tenant:
        account = subjects.account_name(name)
        if account not in self.tenants:
            what, _, shown = subjects.describe(account).partition(" ")
            raise IamError(f"no {what} {shown!r} (see `dsec iam ls`)")
        return self.tenants[account]

    # ---- the server's configuration -----------------------------------------------------------

    def render(self) -> str:
        """The `accounts { ... }` block: DSEC with the platform's users and exports, one account per tenant."""
        lines = ["accounts {", f"  {PLATFORM_ACCOUNT} {{", "    jetstream: enabled", "    users: ["]
        for role, public in sorted(self.platform.items()):
            if not self.live(role):
                continue
            perms = permissions(role, self.pools.get(role[5:], "local"))
            # (no permissions at all for admin and placement: the server then checks nothing per message)
            lines.append(f"      {{nkey: {public}" + (f", permissions: {json.dumps(perms)}}}" if perms else "}"))
        lines += ["    ]", "    exports: ["]
        for kind, subject, position, _ in EXPORTS:
            lines.append(f'      {{{kind}: "{subject}", account_token_position: {position}}}')
        lines += ["    ]", "  }"]
        for name, tenant in sorted(self.tenants.items()):
            lines.append(f"  {name} {{")
            users = sorted(tenant.users.values()) if self.live(f"tenant:{name}") else []
            lines.append("    users: [" + ", ".join(f"{{nkey: {k}}}" for k in users) + "]")
            lines.append("    imports: [")
            for kind, _, _, imported in EXPORTS:
                lines.append(f'      {{{kind}: {{account: {PLATFORM_ACCOUNT}, subject: "{imported.format(t=name)}"}}}}')
            lines += ["    ]", "  }"]
        lines.append("}")
        return "\n".join(lines) + "\n"

    def write_conf(self) -> Path:
        self.conf_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.conf_path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")   # writers never share one
        tmp.write_text(self.render())
        tmp.replace(self.conf_path)
        return self.conf_path


def permissions(role: str, pool: str = "local") -> dict | None:
    """What one platform principal may publish and subscribe to in DSEC; None for admin and placement
    (everything)."""
    if role in ("admin", "placement"):
        return None
    if role == "ops":   # watch and replay: read-only JetStream, no publish of its own
        return {"publish": {"allow": ["$JS.API.>", "$JS.ACK.>", "$JS.FC.>", "_INBOX.>"],
                            "deny": _JS_ADMIN + ["$JS.API.CONSUMER.DELETE.>"] + _WORK_QUEUES},
                "subscribe": {"allow": [">"]}}
    return edge_permissions(role[5:], pool)


def edge_permissions(node: str, pool: str = "local") -> dict:
    """An edge: its own node's lanes and record, output on its own node's subjects. What it cannot be
    scoped on by subject (records and events of the sandboxes it runs, whose keys name no node, and the
    create lane it hands a failed create back to) it shares with every edge; see docs/iam.md."""
    own = [(f"edge-{node}-create", f"dsec.node.{node}.create"), (f"edge-{node}-ops", f"dsec.node.{node}.exec.>"),
           (f"pool-{pool}-create", f"dsec.pool.{pool}.create")]
    readable = [f"KV_{b}" for b in streams.KV_BUCKETS] + [f"OBJ_{streams.LAYERS_OBJ}"]
    publish = [
        f"dsec.out.*.{node}.>", f"dsec.hb.{node}", "dsec.evt.>", "dsec.traj.>", "dsec.reply.>", "dsec.req.create.>",
        "_INBOX.>", "_R_.>", "$JS.ACK.>", "$JS.FC.>",   # (_R_: replies to tenants' stdin through their imports)
        f"$KV.{streams.NODES_KV}.{node}", f"$KV.{streams.SANDBOXES_KV}.>", f"$KV.{streams.SNAPSHOTS_KV}.>",
        f"$O.{streams.LAYERS_OBJ}.>",
        "$JS.API.INFO", "$JS.API.STREAM.INFO.*", "$JS.API.STREAM.NAMES", "$JS.API.STREAM.MSG.GET.*",
        "$JS.API.DIRECT.GET.>", "$JS.API.CONSUMER.INFO.>",
        # consumers on its own lanes only, created with the filter in the subject (the server refuses a
        # body whose filter differs); the shared call lanes every fncall node competes on; bucket reads
        *[f"$JS.API.CONSUMER.CREATE.{streams.NODE_STREAM}.{c}.{f}" for c, f in own],
        *[f"$JS.API.CONSUMER.DELETE.{streams.NODE_STREAM}.{c}" for c, _ in own],
        *[f"$JS.API.CONSUMER.MSG.NEXT.{streams.NODE_STREAM}.{c}" for c, _ in own],
        f"$JS.API.CONSUMER.CREATE.{streams.CALL_STREAM}.>", f"$JS.API.CONSUMER.MSG.NEXT.{streams.CALL_STREAM}.*",
        *[f"$JS.API.CONSUMER.{verb}.{s}{tail}" for s in readable
          for verb, tail in (("CREATE", ""), ("CREATE", ".>"), ("DELETE", ".*"), ("MSG.NEXT", ".*"))],
    ]
    return {"publish": {"allow": publish},
            "subscribe": {"allow": ["_INBOX.>", f"dsec.in.{node}.>", "dsec.hb.*", "dsec.evt.>", "dsec.probe.>",
                                     subjects.layer_dropped()]}}


@contextlib.contextmanager
def state_lock(root: Path):
    """One writer of a state dir's identities at a time (`dsec iam` and the expiry sweep)."""
    lock = Path(root) / "iam" / ".lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def bootstrap(root: Path, nodes: list[str] = (), tenants: list[str] = ("default",), pool: str = "local") -> Iam:
    """The identities `dsec up` needs, made where missing: admin, placement, ops, an edge per node and
    the given tenants, each with its credential under <root>/creds."""
    iam = Iam.load(root)
    for n in nodes:
        iam.pools[n] = pool
    for role in (*ROLES, *(f"edge-{n}" for n in nodes)):
        if role not in iam.platform or not iam.creds_path(role).exists() or not iam.live(role):
            iam.issue_platform(role)
    for name in tenants:
        if name not in iam.tenants:
            iam.add_tenant(name)
        elif (not iam.tenants[name].users or not iam.creds_path(f"tenant:{name}").exists()
              or not iam.live(f"tenant:{name}")):
            iam.issue_tenant(name)
    iam.save()
    return iam
