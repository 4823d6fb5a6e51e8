"""Files of VM sandboxes (microvm, fullvm): every operation is one run of the trusted device's `files`
helper (native/dsec-files.c) by the guest agent, in the guest's root as the sandbox's commands see it, and
a directory watch is its `watch` helper (native/dsec-watch.c, the guest's twin of watcher.py). The VM's own
kernel is the boundary, so a path may lead anywhere in the guest, and nowhere outside it."""
from __future__ import annotations

import asyncio
import errno
import os
import posixpath
import stat as st

from bus.messages import FileEntry, FileOp, FileOpResult, encode
from edge.backends.base import TRUSTED_DIR, BackendError, ExecControl, ExecResult, OutputSink
from edge.backends.rootfiles import file_error
from edge.backends import treeops
from edge.backends.treeops import MAX_ENTRIES

HELPER = f"{TRUSTED_DIR}/files"
WATCHER = f"{TRUSTED_DIR}/watch"
FIELDS = 9           # of an entry, before its xattrs
CURSOR = "hex:"      # a listing's cursor: the guest's bytes of a path
TIMEOUT = 60.0


def entries(out: bytes, raw: list[bytes] | None = None) -> list[FileEntry]:
    """The helper's entries (NUL-terminated fields, see dsec-files.c) as FileEntry, names as the wire shows
    them (treeops.wire_name, as a container's); raw gets each one's path as the guest's bytes."""
    parts = out.split(b"\0")[:-1]
    found: list[FileEntry] = []
    at = 0
    while at + FIELDS <= len(parts):
        if raw is not None:
            raw.append(parts[at])
        path, target = (treeops.wire_name(os.fsdecode(p)) for p in (parts[at], parts[at + 7]))
        kind, size, mode, uid, gid, mtime, count = (p.decode() for p in parts[at + 1:at + 7] + [parts[at + 8]])
        at += FIELDS
        meta = {}
        for _ in range(int(count)):
            meta[parts[at].decode(errors="replace")] = bytes.fromhex(parts[at + 1].decode()).decode(errors="replace")
            at += 2
        found.append(FileEntry(name=posixpath.basename(path) or "/", path=path, type=kind, size=int(size),
                               mode=int(mode, 8), permissions=st.filemode(int(mode, 8))[1:], uid=int(uid),
                               gid=int(gid), mtime=float(mtime), symlink_target=target, metadata=meta))
    return found


class GuestFiles:
    """write_file / read_file / file_op of a VM backend (self._live(id) -> a VM with .chan, .frozen_for)."""

    async def _helper(self, vm, args: list[str], stdin: bytes | None, path: str, creating: bool,
                      user=None) -> bytes:
        """The helper's stdout for args (as user, a users.ExecUser; None: root); its failure (exit status
        errno, stderr why) as BackendError."""
        out = {"stdout": bytearray(), "stderr": bytearray()}

        async def sink(stream, data: bytes) -> None:
            out[stream] += data
        who = ["--as", user.spec()] if user is not None else []
        res = await vm.chan.exec([HELPER, *who, *args], {}, "/", stdin, TIMEOUT, sink, None, vm.frozen_for)
        if res.timed_out:
            raise BackendError(f"file operation on {path} took longer than {TIMEOUT:.0f}s")
        if res.exit_code == errno.EFBIG and args[0] == "list":
            raise BackendError(f"more than {treeops.MAX_SCAN} entries to walk: list a smaller tree or a smaller "
                               f"depth: {path}")
        if res.exit_code == errno.EINVAL and b"piece was lost" in out["stderr"]:
            raise BackendError(f"{out['stderr'].decode(errors='replace').strip()}: {path}")
        if res.exit_code:
            why = out["stderr"].decode(errors="replace").strip().rpartition(": ")[2]
            raise file_error(OSError(res.exit_code, why or os.strerror(res.exit_code)), path, creating)
        return bytes(out["stdout"])

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        """Create or truncate a file inside the guest with exactly mode (its own root: nothing of the host)."""
        await self._helper(self._live(sandbox_id), ["write", path, "0", f"{mode & 0o7777:o}"], data, path, True)

    async def read_file(self, sandbox_id: str, path: str, limit: int) -> bytes:
        """A file of the guest, at most limit bytes (else EFBIG)."""
        out = await self._helper(self._live(sandbox_id), ["read", path, "0", str(limit)], b"", path, False)
        size, _, data = out.partition(b"\0")
        if int(size) > limit:
            raise file_error(OSError(errno.EFBIG, str(limit)), path, False)
        return data

    async def file_op(self, sandbox_id: str, op: FileOp, user=None) -> bytes:
        """One file-tree op in the guest, as user (users.ExecUser; None: the guest's root)."""
        vm = self._live(sandbox_id)
        path = treeops.normal(op.path)

        async def helper(args: list[str], stdin: bytes, creating: bool = False) -> bytes:
            return await self._helper(vm, args, stdin, path, creating, user)
        match op.op:
            case "stat":
                result = FileOpResult(entry=entries(await helper(["stat", path], b""))[0])
            case "list":
                # The cursor is the guest's bytes of a path, in hex (a name need not be UTF-8: the helper
                # orders by bytes, and a cursor read back as text came back as other bytes, which looped)
                cursor = op.after[4:] if op.after.startswith(CURSOR) else os.fsencode(op.after).hex()
                out = await helper(["list", path, str(op.depth), str(MAX_ENTRIES), cursor], b"")
                after, _, out = out.partition(b"\0")
                raw: list[bytes] = []
                found = entries(out, raw)      # (in the helper's order: by bytes)
                result = treeops.page(op, *treeops.fit(found, CURSOR + after.decode() if after else "",
                                                       [CURSOR + r.hex() for r in raw]))
            case "mkdir":
                result = FileOpResult(made=await helper(["mkdir", path], b"", True) == b"1\0")
            case "remove":
                if path == "/":
                    raise BackendError("not on the sandbox root itself: /")
                await helper(["remove", path], b"")
                result = FileOpResult()
            case "rename":
                out = await helper(["rename", path, treeops.normal(op.dest)], b"", True)
                result = FileOpResult(entry=entries(out)[0])
            case "read":
                out = await helper(["read", path, str(op.offset), str(op.length)], b"")
                size, _, data = out.partition(b"\0")
                result = FileOpResult(data=data, size=int(size))
            case "write":
                meta = [x for k, v in dict(op.metadata).items() for x in (k, v.encode().hex())]
                await helper(["write", path, str(op.offset), f"{op.mode & 0o7777:o}", *meta], op.data, True)
                result = FileOpResult()
            case _:
                raise BackendError(f"unknown file op {op.op!r}")
        return encode(result)

    async def watch(self, sandbox_id: str, path: str, recursive: bool, *, timeout: float, sink: OutputSink,
                    control: ExecControl | None = None) -> ExecResult:
        """The guest's watch helper as an exec of its own control (inner): its "ready" line starts the watch
        (control.started(0), as the edge's watcher), the rest is the watch's output; control's signals
        reach it, and each piece written to control comes to it as a line (a flush's mark)."""
        vm = self._live(sandbox_id)
        inner = ExecControl(live_stdin=True)
        ready = asyncio.get_running_loop().create_future()
        head, err = bytearray(), bytearray()

        async def relay(stream: str, data: bytes) -> None:
            if stream == "stderr":
                err.extend(data[:4096])
                return
            if not ready.done():
                head.extend(data)
                if b"\n" not in head:
                    return
                line, _, rest = bytes(head).partition(b"\n")
                ready.set_result(line == b"ready")
                if control is not None:
                    await control.started(0)
                data = rest
            if data:
                await sink("stdout", data)
        marks = None
        if control is not None:
            control.on_signal(inner.signal)
            marks = asyncio.ensure_future(_marks(control, inner))
        try:
            res = await vm.chan.exec([WATCHER, path, "1" if recursive else "0"], {}, "/", b"", timeout, relay,
                                     inner, vm.frozen_for)
        finally:
            if marks is not None:
                marks.cancel()
                await asyncio.gather(marks, return_exceptions=True)
        if not ready.done() or not ready.result():
            why = err.decode(errors="replace").strip().rpartition(": ")[2] or os.strerror(res.exit_code)
            raise BackendError({errno.ENOENT: f"no such directory: {path}", errno.ENOTDIR: f"not a directory: {path}"}
                               .get(res.exit_code, f"cannot watch {path}: {why}"))
        return res


async def _marks(outer: ExecControl, inner: ExecControl) -> None:
    """Pieces written to the watch (its flush marks) to the helper's stdin, a line each."""
    while True:
        data, done = await outer.next_input()
        if data is None:   # the client closed the watch's stdin: no more marks, the watch goes on
            done.set_result(True)
            continue
        done.set_result(await inner.write(data.replace(b"\n", b" ")[:64] + b"\n"))
