"""A backend that starts nothing: sandboxes are names, execs exit 0 at once. For benchmarks that measure
placement and the bus alone (bench/placement.py); never used to serve real work."""
from __future__ import annotations

from edge.backends.base import Backend, ExecResult, SandboxGone, SandboxSpec


class NoopBackend(Backend):
    """In-process, no kernel objects, nothing to leak."""

    kind = "noop"

    def __init__(self) -> None:
        self._ids: set[str] = set()

    async def start(self) -> None:
        """Nothing to reconcile."""

    async def stop(self) -> None:
        """Forget every sandbox."""
        self._ids.clear()

    async def create(self, spec: SandboxSpec) -> None:
        """Remember the id."""
        self._ids.add(spec.id)

    async def exec(self, sandbox_id, argv, *, env, cwd, stdin, timeout, sink, control=None) -> ExecResult:
        """Exit 0 with no output."""
        if sandbox_id not in self._ids:
            raise SandboxGone(sandbox_id)
        return ExecResult(exit_code=0, duration=0.0, cpu_time=0.0, peak_memory=0)

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        """Accept and drop."""
        if sandbox_id not in self._ids:
            raise SandboxGone(sandbox_id)

    async def read_file(self, sandbox_id: str, path: str, limit: int) -> bytes:
        """Always empty."""
        if sandbox_id not in self._ids:
            raise SandboxGone(sandbox_id)
        return b""

    async def destroy(self, sandbox_id: str) -> None:
        """Forget it (idempotent)."""
        self._ids.discard(sandbox_id)

    async def freeze(self, sandbox_id: str) -> None:
        """Nothing runs: nothing to stop."""
        if sandbox_id not in self._ids:
            raise SandboxGone(sandbox_id)

    async def thaw(self, sandbox_id: str) -> None:
        """Nothing to resume."""
        if sandbox_id not in self._ids:
            raise SandboxGone(sandbox_id)

    def sandboxes(self) -> list[str]:
        """The remembered ids."""
        return sorted(self._ids)
