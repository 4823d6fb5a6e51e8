"""ProcessInfo, as in E2B."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional


@dataclass
class ProcessInfo:
    """A running command."""

    pid: int
    tag: Optional[str]
    cmd: str
    args: List[str] = field(default_factory=list)
    envs: Dict[str, str] = field(default_factory=dict)
    cwd: Optional[str] = None
