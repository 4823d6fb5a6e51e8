"""A sandbox's network policy (Aether, issue 16): the one struct every backend's network follows, and its
parser. The SDK, placement and the edge check it the same way, so a bad policy is refused with
InvalidRequest before anything starts (and, changed on a running sandbox, leaves the old one in force).

    none         no network but loopback (the default)
    mirror-only  only the node's package mirrors
    proxied      through the node's Aether proxy, to what `allow` names

An `allow` entry is a host name (`pypi.org`), a wildcard over a domain's subdomains (`*.pythonhosted.org`,
never a bare `*` nor `*.` over a top-level domain alone) or an address range (`198.51.100.0/24`, one
address `198.51.100.7`, IPv6 `[2001:db8::/32]`), each with an optional port or port range after a colon
(`pypi.org:443`, `198.51.100.0/24:8000-8100`); without one it allows ports 80 and 443. Private,
link-local, CGNAT, metadata and host addresses stay denied whatever a tenant lists unless the node's
operator allows a range (`dsec edge --aether-allow-cidr`).
"""
from __future__ import annotations

import ipaddress
import re
from typing import Literal, NamedTuple

import msgspec

from bus.errors import InvalidRequest

MODES = ("none", "mirror-only", "proxied")
MAX_ENTRIES = 256
DEFAULT_PORTS = ((80, 80), (443, 443))
DEFAULT_BANDWIDTH = 100 * 10**6 // 8      # bytes/s when a policy says 0: 100 Mbit/s
DEFAULT_MAX_CONNECTIONS = 256             # open connections at once when a policy says 0
MAX_CONNECTIONS = 4096                    # the most a policy may ask (each costs the node's proxy 6 fds)
_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")


class Network(msgspec.Struct, frozen=True, omit_defaults=True):
    """On the wire and in the sandbox record: what the sandbox may reach."""

    mode: Literal["none", "mirror-only", "proxied"] = "none"
    allow: list[str] = []
    bandwidth: int = 0                    # bytes/s each way; 0: DEFAULT_BANDWIDTH
    max_connections: int = 0              # 0: DEFAULT_MAX_CONNECTIONS

    def summary(self) -> str:
        """One short word for listings: none, mirror-only, or proxied(N)."""
        return f"proxied({len(self.allow)})" if self.mode == "proxied" else self.mode


class Rule(NamedTuple):
    """One parsed allow entry: a name (exact, or a wildcard's domain) or an address range, and its ports."""

    name: str                             # '' for a range
    wildcard: bool                        # name covers its subdomains only (*.name)
    net: ipaddress.IPv4Network | ipaddress.IPv6Network | None
    ports: tuple[tuple[int, int], ...]    # inclusive ranges


def _ports(text: str, entry: str) -> tuple[tuple[int, int], ...]:
    lo, sep, hi = text.partition("-")
    try:
        first, last = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise InvalidRequest(f"network allow entry {entry!r}: bad port {text!r}") from None
    if not 1 <= first <= last <= 65535 or not lo.isdigit() or (sep and not hi.isdigit()):
        raise InvalidRequest(f"network allow entry {entry!r}: ports are 1-65535, a port or lo-hi, got {text!r}")
    return ((first, last),)


def _name(text: str, entry: str) -> tuple[str, bool]:
    wildcard = text.startswith("*.")
    name = text[2:] if wildcard else text
    labels = name.split(".")
    if "*" in name or not name or len(name) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise InvalidRequest(f"network allow entry {entry!r}: not a host name, a *.domain wildcard or an address "
                             f"range (names are lower-case letters, digits, '-' and dots)")
    if wildcard and len(labels) < 2:
        raise InvalidRequest(f"network allow entry {entry!r}: a wildcard must name a domain under a top-level "
                             f"one (*.example.org), not all of {name!r}")
    if labels[-1].isdigit():
        raise InvalidRequest(f"network allow entry {entry!r}: neither a host name nor a valid address")
    return name, wildcard


def parse_entry(entry: str) -> Rule:
    """One allow entry -> Rule; InvalidRequest naming it when malformed."""
    if not isinstance(entry, str) or not entry or len(entry) > 300 or entry != entry.strip():
        raise InvalidRequest(f"network allow entries are non-empty strings without spaces, got {entry!r}")
    text, ports = entry.lower(), DEFAULT_PORTS
    if text.startswith("["):                        # [v6 range]:port
        close = text.find("]")
        if close < 0 or (text[close + 1:] and not text[close + 1:].startswith(":")):
            raise InvalidRequest(f"network allow entry {entry!r}: an IPv6 range is written [2001:db8::/32]:443")
        if text[close + 2:]:
            ports = _ports(text[close + 2:], entry)
        text = text[1:close]
    elif text.count(":") == 1:
        text, port = text.split(":")
        ports = _ports(port, entry)
    elif ":" in text:
        raise InvalidRequest(f"network allow entry {entry!r}: write an IPv6 range in brackets, [2001:db8::/32]:443")
    if text == "*":
        raise InvalidRequest("network allow entry '*': allowing everything is not a policy; list names or ranges")
    if re.fullmatch(r"[0-9.]+(/\d+)?|[0-9a-f:.]*:[0-9a-f:.]*(/\d+)?", text):
        try:
            net = ipaddress.ip_network(text, strict=True)
        except ValueError as exc:
            raise InvalidRequest(f"network allow entry {entry!r}: {exc}") from None
        return Rule("", False, net, ports)
    name, wildcard = _name(text, entry)
    return Rule(name, wildcard, None, ports)


def check(policy: Network) -> Network:
    """The policy as given when it is valid; InvalidRequest naming what is wrong otherwise."""
    if policy.mode not in MODES:
        raise InvalidRequest(f"network mode must be one of {', '.join(MODES)}, got {policy.mode!r}")
    if policy.mode != "proxied" and policy.allow:
        raise InvalidRequest(f"network {policy.mode!r} takes no allow list (use proxied)")
    if len(policy.allow) > MAX_ENTRIES:
        raise InvalidRequest(f"network allow lists take at most {MAX_ENTRIES} entries, got {len(policy.allow)}")
    for entry in policy.allow:
        parse_entry(entry)
    for what, value, top in (("bandwidth", policy.bandwidth, 10**11), ("max_connections", policy.max_connections,
                                                                         MAX_CONNECTIONS)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
            raise InvalidRequest(f"network {what} must be 0 (the node's default) up to {top}, got {value!r}")
    return policy


def matches(rule: Rule, host: str | None, address: ipaddress.IPv4Address | ipaddress.IPv6Address | None,
            port: int) -> bool:
    """Whether a connection to host (a name, or None) at address on port is one rule allows."""
    if not any(lo <= port <= hi for lo, hi in rule.ports):
        return False
    if rule.net is not None:
        return address is not None and address in rule.net
    if host is None:
        return False
    host = host.lower().rstrip(".")
    return host.endswith("." + rule.name) if rule.wildcard else host == rule.name
