"""Fixtures for tests that run real container sandboxes: a busybox EROFS layer and a running backend.

Use from a test module with `from tests.backend_fixtures import *` (or list this module in the
root conftest's `pytest_plugins`). Everything here needs root, cgroup v1, btrfs and catatonit.
"""
from __future__ import annotations

import itertools
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import pytest_asyncio

from edge.backends.base import ExecResult, Limits, SandboxGone, SandboxSpec
from edge.backends.container import ContainerBackend, leftovers
from edge.erofs import busybox_rootfs, pack_dir
from tests import leaks

__all__ = ["busybox_layer", "container_backend", "container_prerequisites", "started_backend", "sandboxes", "Sandboxes", "Run", "requires_container",
           "fixed_state_dir"]


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("mkfs.erofs", "mkfs.btrfs", "btrfs", "catatonit"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    if not Path("/sys/fs/cgroup/freezer").is_dir():
        return "needs cgroup v1 controllers"
    return None


# Never a skip: a machine without these cannot pass the suite, and must say so (make setup installs them).
requires_container = pytest.mark.usefixtures("container_prerequisites")


@pytest.fixture(scope="session")
def container_prerequisites() -> None:
    """Fail (never skip) when root or a system tool the container backend needs is missing."""
    if _missing():
        pytest.fail(f"container backend prerequisites: {_missing()} (run `make setup` as root)")


@pytest.fixture(scope="session")
def busybox_layer(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Path of a busybox EROFS layer file, built once per session."""
    if _missing():
        pytest.fail(f"container backend prerequisites: {_missing()} (run `make setup` as root)")
    work = tmp_path_factory.mktemp("busybox")
    busybox_rootfs(work / "root")
    pack_dir(work / "root", work / "busybox.erofs")
    return str(work / "busybox.erofs")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def container_backend(tmp_path_factory: pytest.TempPathFactory):
    """A started ContainerBackend shared by a module; stopped after it, asserting nothing leaked."""
    if _missing():
        pytest.fail(f"container backend prerequisites: {_missing()} (run `make setup` as root)")
    # Fixed names: a run that crashed before stop() is reconciled by the next run's start().
    state, node = fixed_state_dir(tmp_path_factory, "node"), "tmodule"
    backend = ContainerBackend(state, node, upper_pool_size=8 << 30)
    with leaks.live(node, state):
        await backend.start()
        yield backend
        await backend.stop()
    assert leftovers(state, node) == []


_counter = itertools.count()


async def started_backend(tmp_path_factory: pytest.TempPathFactory,
                          name: str) -> tuple[ContainerBackend, Path, str]:
    """A started backend of its own (fixed state dir, node id "t<name>"), for a test that stops it itself."""
    state, node = fixed_state_dir(tmp_path_factory, name), f"t{name}"
    backend = ContainerBackend(state, node, upper_pool_size=1 << 30)
    await backend.start()
    return backend, state, node


def fixed_state_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A state dir that outlives pytest's basetemp rotation, so leftovers of a crashed run are found."""
    path = tmp_path_factory.getbasetemp().parent / "dsec-backend-tests" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class Run:
    """One finished exec with its collected output."""

    result: ExecResult
    stdout: bytes
    stderr: bytes
    chunks: list[tuple[str, int]] = field(default_factory=list)

    @property
    def out(self) -> str:
        """stdout as text."""
        return self.stdout.decode()


class Sandboxes:
    """Creates sandboxes from the busybox layer, runs commands, and remembers ids for leak checks."""

    def __init__(self, backend: ContainerBackend, layer: str) -> None:
        self.backend = backend
        self.layer = layer
        self.ids: list[str] = []

    async def create(self, limits: Limits | None = None, env: dict[str, str] | None = None,
                     sid: str | None = None) -> str:
        """Create a sandbox; return its id."""
        sid = sid or f"sb{os.getpid()}x{next(_counter)}"
        self.ids.append(sid)
        await self.backend.create(SandboxSpec(sid, [self.layer], limits or Limits(), env or {}))
        return sid

    async def run(self, sid: str, argv: list[str], *, env: dict[str, str] | None = None, cwd: str = "/",
                  stdin: bytes | None = None, timeout: float = 20.0, sink=None) -> Run:
        """Run a command, collecting stdout and stderr."""
        out: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        chunks: list[tuple[str, int]] = []

        async def collect(stream: str, chunk: bytes) -> None:
            out[stream].append(chunk)
            chunks.append((stream, len(chunk)))
            if sink is not None:
                await sink(stream, chunk)

        result = await self.backend.exec(sid, argv, env=env or {}, cwd=cwd, stdin=stdin,
                                         timeout=timeout, sink=collect)
        return Run(result, b"".join(out["stdout"]), b"".join(out["stderr"]), chunks)

    async def cleanup(self) -> list[str]:
        """Destroy what is left; return the residue of every sandbox this helper created."""
        for sid in self.ids:
            try:
                await self.backend.destroy(sid)
            except SandboxGone:
                pass
        return [r for sid in self.ids for r in self.backend.residue(sid)]


@pytest_asyncio.fixture(loop_scope="module")
async def sandboxes(container_backend: ContainerBackend, busybox_layer: str):
    """Per-test sandbox helper; after the test every sandbox is gone without residue."""
    helper = Sandboxes(container_backend, busybox_layer)
    yield helper
    assert await helper.cleanup() == []
    assert container_backend.sandboxes() == []
