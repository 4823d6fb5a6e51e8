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
  the platform learns the tenant from the subject, never from the payload.

The state is `<state>/iam/iam.json` (public keys only); each credential's seed is a `.creds` file under
`<state>/creds/` (mode 0600) that only its holder should keep. Revoking removes the user and reloads the
server, which closes the user's open connections and refuses its next ones.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from bus import creds, streams
from bus.errors import DsecError, InvalidRequest

PLATFORM_ACCOUNT = "DSEC"
RESERVED = {PLATFORM_ACCOUNT, "SYS", "$G", "$SYS", "GLOBAL"}
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
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


class IamError(DsecError):
    """An IAM change was refused (unknown or duplicate name, live sandboxes without --force, ...)."""

    code = "iam"


def check_name(name: str, what: str = "tenant") -> str:
    """A tenant, project or node name: an account name and a subject token at once."""
    if not isinstance(name, str) or not _NAME.match(name) or name.upper() in RESERVED:
        raise InvalidRequest(f"{what} name must be 1-63 characters of [a-z0-9_-] starting with a letter or "
                             f"digit, and not {', '.join(sorted(RESERVED))}; got {name!r}")
    return name


def new_seed() -> tuple[bytes, str]:
    """A fresh user key pair: (seed, public key), from the nkeys package."""
    import nkeys
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return seed, nkeys.from_seed(bytearray(seed)).public_key.decode()


def creds_text(seed: bytes, who: str) -> str:
    """A credential file: the user's nkey seed, decorated as nsc decorates one."""
    return (f"# DSec credential for {who}. Keep it secret: it is the identity.\n"
            f"-----BEGIN USER NKEY SEED-----\n{seed.decode()}\n------END USER NKEY SEED------\n")


@dataclass
class Tenant:
    users: dict[str, str] = field(default_factory=dict)   # user name -> public key
    rate: float = 0.0     # control API requests/s (0: the default), mirrored into the quota record


@dataclass
class Iam:
    """The identities of one DSec installation (its state dir)."""

    root: Path
    platform: dict[str, str] = field(default_factory=dict)   # admin/placement/ops/edge-<node> -> public key
    tenants: dict[str, Tenant] = field(default_factory=dict)
    pools: dict[str, str] = field(default_factory=dict)   # node -> the pool its edge serves (default local)

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
            iam.tenants = {n: Tenant(dict(t.get("users", {})), float(t.get("rate", 0.0)))
                           for n, t in data.get("tenants", {}).items()}
        return iam

    @property
    def exists(self) -> bool:
        return self.path.exists()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"version": 1, "platform": self.platform, "pools": self.pools,
                "tenants": {n: {"users": t.users, "rate": t.rate} for n, t in sorted(self.tenants.items())}}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(self.path)
        self.write_conf()

    # ---- credentials --------------------------------------------------------------------------

    def creds_path(self, principal: str) -> Path:
        """Where a principal's credential is written: creds/<role>.creds, creds/tenants/<tenant>.creds."""
        return creds.creds_path(self.root, principal)

    def _mint(self, principal: str) -> tuple[str, Path]:
        seed, public = new_seed()
        path = self.creds_path(principal)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(creds_text(seed, principal))
        tmp.replace(path)
        return public, path

    def issue_platform(self, role: str) -> Path:
        """Mint (or mint anew, revoking the old key) a platform principal's credential."""
        if role not in ROLES and not (role.startswith("edge-") and check_name(role[5:], "node")):
            raise InvalidRequest(f"platform role must be one of {', '.join(ROLES)} or edge-<node>, got {role!r}")
        public, path = self._mint(role)
        self.platform[role] = public
        return path

    def add_tenant(self, name: str, rate: float = 0.0) -> Path:
        check_name(name)
        if name in self.tenants:
            raise IamError(f"tenant {name!r} exists already")
        self.tenants[name] = Tenant(rate=rate)
        return self.issue_tenant(name)

    def issue_tenant(self, name: str) -> Path:
        """A new credential for a tenant; its earlier one stops working (at the next reload)."""
        tenant = self.tenant(name)
        public, path = self._mint(f"tenant:{name}")
        tenant.users = {name: public}
        return path

    def revoke(self, principal: str) -> None:
        """Remove a credential: a tenant's (`tenant:<name>`) or a platform role's."""
        if principal.startswith("tenant:"):
            self.tenant(principal[7:]).users.clear()
        elif principal in self.platform:
            del self.platform[principal]
        else:
            raise IamError(f"no credential {principal!r} (see `dsec iam ls`)")
        self.creds_path(principal).unlink(missing_ok=True)

    def remove_tenant(self, name: str) -> None:
        self.tenant(name)
        del self.tenants[name]
        self.creds_path(f"tenant:{name}").unlink(missing_ok=True)

    def tenant(self, name: str) -> Tenant:
        if name not in self.tenants:
            raise IamError(f"no tenant {name!r} (see `dsec iam ls`)")
        return self.tenants[name]

    # ---- the server's configuration -----------------------------------------------------------

    def render(self) -> str:
        """The `accounts { ... }` block: DSEC with the platform's users and exports, one account per tenant."""
        lines = ["accounts {", f"  {PLATFORM_ACCOUNT} {{", "    jetstream: enabled", "    users: ["]
        for role, public in sorted(self.platform.items()):
            perms = permissions(role, self.pools.get(role[5:], "local"))
            # (no permissions at all for admin and placement: the server then checks nothing per message)
            lines.append(f"      {{nkey: {public}" + (f", permissions: {json.dumps(perms)}}}" if perms else "}"))
        lines += ["    ]", "    exports: ["]
        for kind, subject, position, _ in EXPORTS:
            lines.append(f'      {{{kind}: "{subject}", account_token_position: {position}}}')
        lines += ["    ]", "  }"]
        for name, tenant in sorted(self.tenants.items()):
            lines.append(f"  {name} {{")
            lines.append("    users: [" + ", ".join(f"{{nkey: {k}}}" for k in sorted(tenant.users.values())) + "]")
            lines.append("    imports: [")
            for kind, _, _, imported in EXPORTS:
                lines.append(f'      {{{kind}: {{account: {PLATFORM_ACCOUNT}, subject: "{imported.format(t=name)}"}}}}')
            lines += ["    ]", "  }"]
        lines.append("}")
        return "\n".join(lines) + "\n"

    def write_conf(self) -> Path:
        self.conf_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.conf_path.with_suffix(".tmp")
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
            "subscribe": {"allow": ["_INBOX.>", f"dsec.in.{node}.>", "dsec.hb.*", "dsec.evt.>", "dsec.probe.>"]}}


# ---- the server's side: its configuration file, and reloads ------------------------------------------

def server_conf(iam: Iam, base: Path) -> Path:
    """`<state>/iam/server.conf`: the repo's nats.conf with the accounts included (nats-server includes
    only relative paths, so the base is copied beside it)."""
    iam.write_conf()
    path = iam.root / "iam" / "server.conf"
    text = base.read_text() if base.exists() else ""
    path.write_text(text + f"\n# Identities (written by dsec: `dsec iam`, see bus/iam.py)\n"
                           f"include \"{iam.conf_path.name}\"\n")
    return path


def _servers_file(iam: Iam) -> Path:
    return iam.root / "iam" / "servers.json"


def register_server(iam: Iam, pid: int, log: Path) -> None:
    """Remember a running server of these identities (pid, log) so `dsec iam` can reload it."""
    path = _servers_file(iam)
    known = [s for s in _servers(iam) if psutil.pid_exists(s["pid"]) and s["pid"] != pid]
    known.append({"pid": pid, "log": str(log)})
    path.write_text(json.dumps(known))


def _servers(iam: Iam) -> list[dict]:
    try:
        return list(json.loads(_servers_file(iam).read_text()))
    except (OSError, ValueError):
        return []


RELOADED = "Reloaded server configuration"


def reload(iam: Iam, timeout: float = 10.0) -> int:
    """Make every live server of these identities re-read them (SIGHUP); wait until each logs that it
    did. Returns how many were reloaded; IamError when one refuses the configuration.

    Each server is reloaded twice: nats-server (2.15.1 here) leaves the service imports of an account that
    a reload adds unwired until the next reload (its stream imports work at once); a second reload of
    the same configuration wires them (tests/test_iam.py adds a tenant at run time and uses it)."""
    done = 0
    for s in _servers(iam):
        if not psutil.pid_exists(s["pid"]):
            continue
        _reload_one(s, timeout)
        _reload_one(s, timeout)
        done += 1
    return done


def _reload_one(s: dict, timeout: float) -> None:
    """SIGHUP one server; wait until its log says it reloaded (IamError if it refused or said nothing)."""
    log = Path(s["log"])
    mark = log.stat().st_size if log.exists() else 0
    os.kill(s["pid"], signal.SIGHUP)
    deadline = time.monotonic() + timeout
    while True:
        with open(log, "rb") as f:   # only what the server wrote since the signal
            f.seek(mark)
            text = f.read().decode(errors="replace")
        if RELOADED in text:
            break
        failed = [line for line in text.splitlines() if "Failed to reload" in line or "[FTL]" in line]
        if failed:
            raise IamError(f"the NATS server refused the new identities: {failed[-1]}")
        if time.monotonic() > deadline:
            raise IamError(f"the NATS server (pid {s['pid']}) did not reload within {timeout:.0f}s (see {log})")
        time.sleep(0.02)


def bootstrap(root: Path, nodes: list[str] = (), tenants: list[str] = ("default",), pool: str = "local") -> Iam:
    """The identities `dsec up` needs, made where missing: admin, placement, ops, an edge per node and
    the given tenants, each with its credential under <root>/creds."""
    iam = Iam.load(root)
    for n in nodes:
        iam.pools[n] = pool
    for role in (*ROLES, *(f"edge-{n}" for n in nodes)):
        if role not in iam.platform or not iam.creds_path(role).exists():
            iam.issue_platform(role)
    for name in tenants:
        if name not in iam.tenants:
            iam.add_tenant(name)
        elif not iam.tenants[name].users or not iam.creds_path(f"tenant:{name}").exists():
            iam.issue_tenant(name)
    iam.save()
    return iam
