"""What the proxy holds per sandbox (its policy, open connections, decisions) and the node-wide address
guard. The guard denies what no tenant may reach whatever its allow list says: the host's own addresses,
the node's sandboxes, and every address that is not global (private, loopback, link-local, CGNAT,
metadata, documentation, reserved, multicast, IPv6) unless the node's operator allowed its range
(`dsec edge --aether-allow-cidr`); the host and the sandboxes stay denied even then."""
from __future__ import annotations

import collections
import ipaddress
import time
from dataclasses import dataclass, field

import psutil

from bus.network import DEFAULT_MAX_CONNECTIONS, Network, Rule, matches, parse_entry
from bus.subjects import tenant_root

WINDOW = 10.0               # seconds over which a sandbox's decisions are counted
DECISIONS_PER_WINDOW = 20   # written one by one per window; past it, only counted (a flood stays small)
HOST_REFRESH = 5.0          # seconds between reads of the host's addresses
QUERY_RATE = 200.0          # DNS questions a sandbox asks a second (past it they are dropped: asked again)...
QUERY_BURST = 400.0         # ... after a burst of this many

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class Guard:
    """The node-wide address rules."""

    def __init__(self, operator_allow: list[str], sandboxes: str) -> None:
        self.operator_allow = [ipaddress.ip_network(c, strict=False) for c in operator_allow]
        self.sandboxes = ipaddress.ip_network(sandboxes) if sandboxes else None
        self._host: set[Address] = set()
        self._read_at = 0.0

    def host_addresses(self) -> set[Address]:
        if time.monotonic() - self._read_at > HOST_REFRESH:
            found = set()
            for addrs in psutil.net_if_addrs().values():
                for a in addrs:
                    try:
                        found.add(ipaddress.ip_address(a.address.split("%")[0]))
                    except ValueError:
                        pass
            self._host, self._read_at = found, time.monotonic()
        return self._host

    def denied(self, address: Address) -> str | None:
        """Why address may not be reached by any sandbox, or None."""
        if address.version != 4:
            return "IPv6 is not routed for sandboxes"
        if address in self.host_addresses() or address.is_loopback or address.is_unspecified:
            return "an address of the host"
        if self.sandboxes is not None and address in self.sandboxes:
            return "a sandbox's address"
        if any(address in net for net in self.operator_allow):
            return None
        if not address.is_global or address.is_multicast:
            return "a private, link-local, shared or reserved address"
        return None


@dataclass
class Decision:
    at: float
    verdict: str            # allowed (reported at its close, with its bytes) | denied | failed (upstream)
    name: str               # host name asked for ('' for an address)
    address: str
    port: int
    reason: str = ""        # why denied, or how it was matched
    bytes_out: int = 0      # sandbox -> upstream
    bytes_in: int = 0       # upstream -> sandbox

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v or k in ("verdict", "port")}


@dataclass(eq=False)
class SandboxState:
    """One sandbox's policy and counters in the proxy."""

    sandbox: str
    policy: Network
    rules: list[Rule] = field(default_factory=list)
    tenant: str = ""        # whose (its tenant: a project's is the tenant above it)
    open: int = 0
    mirror_open: int = 0    # of those, to the node's mirrors
    mirror_queue: collections.deque = field(default_factory=collections.deque)   # futures of those waiting for a
    mirror_waiting: int = 0     # place (aether/mirrorplaces.py), and how many of them still wait
    pending: list[Decision] = field(default_factory=list)
    window_start: float = 0.0
    written: int = 0        # decisions written in this window
    suppressed: dict = field(default_factory=lambda: {"allowed": 0, "denied": 0, "bytes": 0})
    live: set = field(default_factory=set)   # its connections (proxy.Connection) from accept to close
    lookups: int = 0        # its DNS questions waiting on the upstream resolver
    queries: float = QUERY_BURST   # DNS questions it may ask now (a bucket refilled at QUERY_RATE a second)
    queried_at: float = 0.0

    def query_allowed(self, now: float) -> bool:
        """One more DNS question within its rate: one sandbox's flood of 300,000 in 25 s made other tenants'
        lookups fail and stall 2 s, on the node's one resolver socket (helper A3)."""
        self.queries = min(QUERY_BURST, self.queries + (now - self.queried_at) * QUERY_RATE)
        self.queried_at = now
        if self.queries < 1:
            return False
        self.queries -= 1
        return True

    @property
    def owner(self) -> str:
        """Whose share of the proxy its connections take: its tenant's (one not named: its own)."""
        return self.tenant or self.sandbox

    @classmethod
    def of(cls, sandbox: str, policy: Network, tenant: str = "") -> "SandboxState":
        return cls(sandbox, policy, [parse_entry(e) for e in policy.allow], tenant=tenant_root(tenant))

    def update(self, policy: Network) -> None:
        self.policy, self.rules = policy, [parse_entry(e) for e in policy.allow]

    def close_all(self) -> None:
        """The sandbox is gone: every connection of it ends now."""
        for conn in list(self.live):
            conn.cut("the sandbox's network ended")

    def close_revoked(self) -> None:
        """After a policy change: every connection it no longer allows ends now (one still being decided
        is decided by the new policy)."""
        for conn in list(self.live):
            if conn.decided and not conn.still_allowed():
                conn.cut("no longer in the allow list")

    @property
    def max_connections(self) -> int:
        return self.policy.max_connections or DEFAULT_MAX_CONNECTIONS

    def name_allowed(self, name: str, port: int | None) -> bool:
        """Whether a rule names `name` (on port; any port when None: a DNS question)."""
        if self.policy.mode != "proxied":
            return False
        return any(rule.net is None and matches(rule, name, None, rule.ports[0][0] if port is None else port)
                   for rule in self.rules)

    def address_allowed(self, address: Address, port: int) -> bool:
        return self.policy.mode == "proxied" and any(r.net is not None and matches(r, None, address, port)
                                                     for r in self.rules)

    def note(self, decision: Decision) -> None:
        """Record a decision: written, or only counted once this window's are spent."""
        now = time.monotonic()
        if now - self.window_start > WINDOW:
            self.window_start, self.written = now, 0
        if self.written < DECISIONS_PER_WINDOW:
            self.written += 1
            self.pending.append(decision)
        else:
            self.suppressed[decision.verdict] = self.suppressed.get(decision.verdict, 0) + 1
            self.suppressed["bytes"] += decision.bytes_in + decision.bytes_out

    def take(self) -> dict | None:
        """What to report now (decisions, and counts of those only counted), or None."""
        if not self.pending and not any(self.suppressed.values()):
            return None
        out = {"sandbox": self.sandbox, "decisions": [d.to_dict() for d in self.pending]}
        if any(self.suppressed.values()):
            out["suppressed"] = dict(self.suppressed)
        self.pending = []
        self.suppressed = {"allowed": 0, "denied": 0, "bytes": 0}
        return out
