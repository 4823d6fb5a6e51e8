"""Network policies as users write them: `network="none"` (default), `"mirror-only"`, or
`Network(allow=["pypi.org", "*.pythonhosted.org", "198.51.100.0/24:443"])` (proxied), parsed into the wire
form (bus/network.py says what an entry may be) with InvalidRequest naming what is wrong."""
from __future__ import annotations

from dataclasses import dataclass, field

from bus import network as policy
from bus.errors import InvalidRequest
from libdsec.resources import parse_size


@dataclass(frozen=True)
class Network:
    """A proxied network: what the sandbox may reach through its node's Aether proxy. bandwidth is bytes/s
    each way (a size: '10Mi'), None for the node's default (100 Mbit/s); max_connections None for 256."""

    allow: list[str] = field(default_factory=list)
    bandwidth: int | str | None = None
    max_connections: int | None = None

    def to_wire(self) -> policy.Network:
        if isinstance(self.allow, str) or not isinstance(self.allow, (list, tuple)):
            raise InvalidRequest(f"network allow must be a list of entries, got {self.allow!r}")
        bandwidth = 0 if self.bandwidth is None else parse_size(self.bandwidth, "network bandwidth")
        connections = 0 if self.max_connections is None else self.max_connections
        return policy.check(policy.Network(mode="proxied", allow=list(self.allow), bandwidth=bandwidth,
                                           max_connections=connections))


def to_wire(network: Network | str | None) -> policy.Network:
    """create(network=...) -> the checked wire policy."""
    if network is None:
        return policy.Network()
    if isinstance(network, Network):
        return network.to_wire()
    if isinstance(network, str) and network in policy.MODES:
        return policy.Network(mode=network)   # type: ignore[arg-type]
    raise InvalidRequest(f"network must be one of {', '.join(repr(m) for m in policy.MODES)} or "
                         f"libdsec.Network(allow=[...]), got {network!r}")
