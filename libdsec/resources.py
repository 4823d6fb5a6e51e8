"""Resources as users write them ("256Mi", 1.5 cores), parsed into the wire form with errors naming the field."""
from __future__ import annotations

import re
from dataclasses import dataclass

from bus.errors import InvalidRequest
from bus.messages import Resources as WireResources

SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]i?|[kmgtp]i?|B|b)?\s*$")
_UNITS = {"": 1, "b": 1, "k": 1000, "ki": 1 << 10, "m": 1000 ** 2, "mi": 1 << 20, "g": 1000 ** 3, "gi": 1 << 30,
          "t": 1000 ** 4, "ti": 1 << 40, "p": 1000 ** 5, "pi": 1 << 50}


def parse_size(value: int | str, field: str) -> int:
    """'256Mi', '1G', '512k' or a byte count -> bytes; InvalidRequest naming `field` otherwise."""
    if isinstance(value, bool):
        raise InvalidRequest(f"{field} must be a size like '256Mi' or a byte count, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and (m := SIZE.match(value)):
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    else:
        raise InvalidRequest(f"{field} must be a size like '256Mi' or a byte count, got {value!r}")
    if n <= 0:
        raise InvalidRequest(f"{field} must be positive, got {value!r}")
    return n


@dataclass(frozen=True)
class Resources:
    """What one sandbox may use: cores, memory (swap capped equal), processes, writable-layer size."""

    cpu: float = 1.0
    memory: int | str = "256Mi"
    pids: int = 256
    disk: int | str = "256Mi"

    @classmethod
    def of(cls, value: "Resources | dict | None") -> "Resources":
        """Resources given as Resources, a dict of its fields ({"cpu": 2, "memory": "1Gi"}) or None (the
        defaults); InvalidRequest for anything else."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(str(k) for k in value if k not in ("cpu", "memory", "pids", "disk"))
            if unknown:
                raise InvalidRequest(f"resources: unknown field(s) {', '.join(unknown)}; cpu, memory, pids, disk")
            return cls(**value)
        raise InvalidRequest(f"resources must be a libdsec.Resources or a dict of cpu, memory, pids, disk; "
                             f"got {type(value).__name__}")

    def to_wire(self) -> WireResources:
        """Validate and normalise to cores and bytes."""
        if isinstance(self.cpu, bool) or not isinstance(self.cpu, (int, float)) or not 0 < self.cpu < float("inf"):
            raise InvalidRequest(f"resources.cpu must be a positive number of cores, got {self.cpu!r}")
        if isinstance(self.pids, bool) or not isinstance(self.pids, int) or self.pids < 1:
            raise InvalidRequest(f"resources.pids must be a positive integer, got {self.pids!r}")
        return WireResources(cpu=float(self.cpu), memory=parse_size(self.memory, "resources.memory"),
                             pids=self.pids, disk=parse_size(self.disk, "resources.disk"))
