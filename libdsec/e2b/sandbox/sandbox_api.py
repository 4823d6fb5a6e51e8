"""SandboxInfo, SandboxQuery and SandboxState, as in E2B."""
from __future__ import annotations

import datetime
import enum
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional


class SandboxState(str, enum.Enum):
    """A sandbox's state: running, or paused (DSec's suspended)."""

    RUNNING = "running"
    PAUSED = "paused"


@dataclass
class SandboxQuery:
    """Which sandboxes list() returns: all of these labels (metadata) and one of these states."""

    metadata: Optional[Dict[str, str]] = None
    state: Optional[List[SandboxState]] = None
    template: Optional[str] = None                       # its template (image) only
    started_after: Optional[datetime.datetime] = None    # started after this moment only


@dataclass
class SandboxInfo:
    """A sandbox, as list() and get_info() give it."""

    sandbox_id: str
    template_id: str
    name: Optional[str]
    metadata: Dict[str, str]
    started_at: datetime.datetime
    end_at: datetime.datetime
    state: SandboxState
    cpu_count: int                      # as E2B's, whole cores: DSec's cores rounded up (0.5 -> 1)
    memory_mb: int
    envd_version: str = "dsec"
    sandbox_domain: Optional[str] = None   # (none: a DSec sandbox has no public domain)


def info_of(rec) -> SandboxInfo:
    """A SandboxInfo from DSec's SandboxRecord."""
    utc = datetime.timezone.utc
    return SandboxInfo(sandbox_id=rec.sandbox_id, template_id=rec.image, name=rec.image, metadata=dict(rec.labels),
                       started_at=datetime.datetime.fromtimestamp(rec.created_at, utc),
                       end_at=datetime.datetime.fromtimestamp(rec.expires_at or rec.created_at, utc),
                       state=SandboxState.PAUSED if rec.suspended else SandboxState.RUNNING,
                       cpu_count=max(1, math.ceil(rec.resources.cpu)), memory_mb=rec.resources.memory >> 20)


@dataclass
class SnapshotInfo:
    """A snapshot: its id (give it to create() as the template) and names (its tag, when it has one)."""

    snapshot_id: str
    names: List[str] = field(default_factory=list)


def snapshot_info(rec) -> SnapshotInfo:
    """A SnapshotInfo from DSec's SnapshotRecord."""
    return SnapshotInfo(snapshot_id=rec.id, names=[rec.tag] if rec.tag else [])
