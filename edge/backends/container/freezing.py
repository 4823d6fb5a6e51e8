"""Suspend (freezer cgroup) and snapshot (pack the writable layer while frozen) of container sandboxes."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

from edge.backends import cgroups, packing
from edge.backends.base import BackendError, SnapshotTooLarge
from edge.backends.container.state import Core


class Freezing(Core):
    """freeze / thaw / pack_upper."""

    async def freeze(self, sandbox_id: str) -> None:
        """Freeze the sandbox's freezer group: its init, its execs, everything they started."""
        sb = self._live(sandbox_id)
        if sb.frozen_since is not None:
            return
        group = self._cgroups.sandbox(sb.key)["freezer"]
        sb.frozen_since = time.monotonic()
        try:
            if not await cgroups.freeze(group):
                cgroups.thaw(group)
                raise BackendError(f"sandbox {sandbox_id} did not freeze within 5 s (a task in uninterruptible sleep)")
        except OSError as exc:
            raise BackendError(f"cannot freeze {sandbox_id}: {exc}") from exc
        except BaseException:
            sb.frozen_since = None
            raise

    async def thaw(self, sandbox_id: str) -> None:
        """Thaw it: every process runs on from where it stopped."""
        sb = self._live(sandbox_id)
        if sb.frozen_since is None:
            return
        try:
            cgroups.thaw(self._cgroups.sandbox(sb.key)["freezer"])
        except OSError as exc:
            raise BackendError(f"cannot thaw {sandbox_id}: {exc}") from exc
        sb.frozen_total += time.monotonic() - sb.frozen_since
        sb.frozen_since = None

    async def pack_upper(self, sandbox_id: str, dst: str) -> str:
        """Freeze (unless suspended already), pack upper/ with mkfs.erofs, thaw: the freeze lasts the pack.
        The layer is read through an idmapped view, so its files are owned relative to the sandbox. A
        layer whose files add up (at their apparent size: sparse files and reflinks count in full, as
        mkfs.erofs reads them) to more than the sandbox's disk limit is refused (SnapshotTooLarge). Holes
        of sparse files are kept as holes (a 1,000 MiB sparse file cost 1,000 MiB of store and of every
        node's cache: helper F2), which costs the pack a read of them."""
        from edge.erofs import LayerBuildError
        sb = self._live(sandbox_id)
        was_frozen = sb.frozen_since is not None
        if not was_frozen:
            await self.freeze(sandbox_id)
        upper = self._uppers.root / sb.key / "upper"
        try:
            try:
                size, holes = await asyncio.to_thread(packing.apparent_size, upper)
            except SnapshotTooLarge as exc:
                raise SnapshotTooLarge(f"snapshot of {sandbox_id} refused: {exc}") from None
            if size > sb.spec.limits.disk:
                raise SnapshotTooLarge(f"snapshot of {sandbox_id} refused: its files add up to {size} bytes "
                                       f"(sparse and reflinked files counted at their apparent size), above "
                                       f"its disk limit of {sb.spec.limits.disk} bytes")
            return await asyncio.to_thread(packing.pack_relative, upper, Path(dst), sb.ids, self._packing / sb.key,
                                           packing.keeps_holes(size, holes))
        except (LayerBuildError, OSError) as exc:   # (named as the sandbox sees it; the edge adds whose)
            text = str(exc)
            for host in (str(self._packing / sb.key), str(upper), str(Path(dst).parent)):
                text = text.replace(host, "")
            raise BackendError(text) from exc
        finally:
            if not was_frozen:
                await self.thaw(sandbox_id)
