"""The edge's side of sandbox networks: it runs the node's Aether (aether/node.py), hands it to the
backends (their one hook: attach/detach), changes a running sandbox's policy (set_network: the record
follows once the proxy has it in force) and writes the proxy's decisions on each sandbox's trajectory
timeline (records of type "network", at most one a second per sandbox, each with at most 20 decisions;
the rest counted)."""
from __future__ import annotations

import asyncio
import dataclasses
import collections
import logging
import time
from pathlib import Path

from bus import subjects
from bus.errors import InvalidRequest, Unsupported
from bus.messages import encode
from bus.records import TrajRecord
from bus.network import Network, check
from edge.capacity import EdgeConfig
from edge.outbox import Publish

log = logging.getLogger(__name__)


class NodeNetwork:
    """Aether for one edge (None inside when the node runs without it)."""

    def __init__(self, node: str, config: EdgeConfig, box, state_dir: Path) -> None:
        self.node, self.config, self.box, self.state_dir = node, config, box, Path(state_dir)
        self.aether = None
        self.mirrors: list = []          # the node's mirror processes (aether/mirrors.py)
        self._reports: collections.Counter = collections.Counter()   # sandbox -> network records written
        self._writing: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Start the node's Aether; without nftables or the rights, the node runs without it (a warning)."""
        if not self.config.aether:
            return
        from aether.links import LinkError
        from aether.nft import NftError
        from aether.node import Aether, AetherError
        ports = await self._start_mirrors()
        aether = Aether(self.node, self.config.aether_dns, self.config.aether_allow_cidr, on_report=self._report,
                        mirrors=ports)
        try:
            await aether.start()
        except (AetherError, LinkError, NftError, OSError) as exc:
            log.warning("node %s runs without Aether (sandboxes get loopback only): %s", self.node, exc)
            await self._stop_mirrors()
            return
        self.aether = aether

    async def _start_mirrors(self) -> dict[int, int]:
        """The node's mirrors (gateway port -> local port); one that cannot start is left out, with a warning."""
        if not self.config.mirrors:
            return {}
        from aether import mirrors
        base = self.state_dir / "mirrors"
        for name, make, upstream in (("pip", mirrors.pip_mirror, self.config.mirror_pypi),
                                     ("apt", mirrors.apt_mirror, self.config.mirror_apt)):
            mirror = None
            try:
                mirror = make(base, self.node, upstream)
                await mirror.start()
            except (mirrors.MirrorError, OSError) as exc:
                log.warning("node %s runs without its %s mirror: %s", self.node, name, exc)
                if mirror is not None:
                    await mirror.stop()
                continue
            self.mirrors.append(mirror)
        return {m.gateway_port: m.port for m in self.mirrors}

    async def _stop_mirrors(self) -> None:
        for m in self.mirrors:
            await m.stop()
        self.mirrors = []

    async def stop(self) -> None:
        if self.aether is not None:
            await self.aether.stop()
            self.aether = None
        await self._stop_mirrors()

    async def set_policy(self, sandbox_id: str, policy: Network) -> None:
        """A running sandbox's new policy: in force once this returns, and in its record. A bad one is
        refused (InvalidRequest) with the old one left in force."""
        check(policy)
        running = self.box.running.get(sandbox_id)
        if running is None:
            raise KeyError(sandbox_id)
        if running.record.network.mode == "none" or running.spec is None or running.spec.network is None:
            raise Unsupported(f"sandbox {sandbox_id} was created with network 'none' (loopback only): its "
                              f"network cannot be changed; create it with a network")
        if policy.mode == "none":
            raise InvalidRequest("a sandbox's network cannot be changed to 'none' once it has one; use "
                                 "mirror-only or an empty proxied allow list to cut it off")
        if self.aether is None:
            raise Unsupported(f"node {self.node} runs no Aether now")
        await self.aether.set_policy(sandbox_id, policy)
        running.spec = dataclasses.replace(running.spec, network=policy)
        await self.box.record(running, network=policy)

    def _report(self, sandbox_id: str, report: dict) -> None:
        running = self.box.running.get(sandbox_id)
        if running is None:
            return
        rec = running.record
        n = self._reports[sandbox_id] = self._reports[sandbox_id] + 1
        if len(self._reports) > 100_000:
            self._reports = collections.Counter({k: v for k, v in self._reports.items() if k in self.box.running})
        job = subjects.job_of(rec.labels)
        traj = TrajRecord(id=f"{sandbox_id}.network.{n}", type="network", sandbox_id=sandbox_id, tenant=rec.tenant,
                          job=job, node=self.node, at=time.time(), decisions=report.get("decisions", []),
                          suppressed=report.get("suppressed", {}))
        publish = Publish(subjects.trajectory(rec.tenant, job, sandbox_id), encode(traj),
                          f"{sandbox_id}.network.{n}.{self.node}.{rec.epoch}")
        task = asyncio.ensure_future(self.box.records.change(None, sandbox_id, publishes=[publish]))
        self._writing.add(task)
        task.add_done_callback(self._written)

    def _written(self, task: asyncio.Task) -> None:
        self._writing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("a network record was not written: %s", task.exception())
