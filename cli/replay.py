"""`dsec replay`: print a sandbox's (or a job's) episode from the trajectory stream, after the fact."""
from __future__ import annotations

import asyncio
import contextlib
import datetime
import re
import shlex
import sys
import time
from typing import NamedTuple

import click
import msgspec

from bus import streams, subjects
from bus.conn import Bus
from bus.errors import DsecError
from bus.messages import encode
from bus.records import TrajRecord
from bus.execwire import ExitRecord, OutputChunk, StartRecord, decode_output
from cli.main import connect, fail, main, nats_option, run_async
from cli.termsafe import Terminal, escape
from libdsec.execstream import LineSplitter
from chronus.trajreader import consumer_config, read

ENDS = ("destroyed", "expired", "failed", "node_lost")   # records after which a sandbox's episode is over
MARK = {"stdout": b"1| ", "stderr": b"2| "}
NO_NEWLINE = b"\\ no newline at end\n"
_AGO = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")


class Stored(NamedTuple):
    """An exec's records from dsec.out: its start record (if its kind reports one), its chunks in order, its
    exit record; kept_only: they aged out, the chunks are the part its trajectory record kept."""

    start: StartRecord | None
    chunks: list[OutputChunk]
    exit: ExitRecord | None
    kept_only: bool

    def aged_out(self) -> int:
        """Records the exit record counts before it that dsec.out no longer holds."""
        if self.exit is None:
            return 0
        return self.exit.seq - 1 - len(self.chunks) - (self.start is not None)


async def _output(bus: Bus, rec: TrajRecord) -> Stored:
    """The exec's full output in order and its start and exit records, from dsec.out (byte-identical to what
    the SDK saw); when that has aged out, the part kept in the trajectory record."""
    chunks: dict[int, OutputChunk] = {}
    exit_rec = start = None
    for subject in (subjects.output(rec.tenant, rec.node, rec.sandbox_id, rec.exec_id),
                    f"dsec.out.{rec.sandbox_id}.{rec.exec_id}"):   # (stored before the subject named tenant and node)
        async for data, headers in bus.read_subject(streams.OUT_STREAM, subject, with_headers=True):
            try:
                r = decode_output(data, headers)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if isinstance(r, OutputChunk):
                chunks.setdefault(r.seq, r)
            elif isinstance(r, StartRecord):
                start = r
            else:
                exit_rec = r
        if chunks or exit_rec is not None or start is not None:
            break
    if chunks or exit_rec is not None or not (rec.stdout or rec.stderr):
        return Stored(start, [chunks[k] for k in sorted(chunks)], exit_rec, False)
    return Stored(start, [c for c in (OutputChunk(exec_id=rec.exec_id, seq=1, stream="stdout", data=rec.stdout,
                                                  stream_seq=1),
                                      OutputChunk(exec_id=rec.exec_id, seq=2, stream="stderr", data=rec.stderr,
                                                  stream_seq=1)) if c.data], None, True)


def one_line(text: str) -> str:
    """A tenant's text (a command, a cwd, a user, a detail) inside one line of the text replay: every control
    (newlines too) escaped, tty or not, so no value can end its line and forge the next: a script
    `true\n# exit 0 ...` printed a lookalike exit line (helper T2)."""
    return escape(text).replace("\n", "\\n").replace("\t", "\\t")


def _command(rec: TrajRecord) -> str:
    if rec.watch:
        return f"# watch {one_line(rec.watch)} (its changes, a JSON line each)"
    command = one_line(rec.shell if rec.shell else shlex.join(rec.argv))
    if rec.command_cut:   # (only the command's first 64 KiB are kept: chronus/trajfit.py)
        command += f" ...[cut: {rec.command_bytes:,} bytes were sent, sha256 {rec.command_sha256}]"
    return command


def marked(chunks: list[OutputChunk]) -> bytes:
    """Output as text: each line marked by its stream ("1| " stdout, "2| " stderr) in the order the
    lines were completed; a last line without a newline is followed by a "\\ no newline at end" line.
    Stripping the marks gives back each stream byte for byte."""
    lines = LineSplitter()
    out = bytearray()
    for chunk in chunks:
        for line in lines.feed(chunk.stream, chunk.data):
            out += MARK[line.stream] + line.data
    for line in lines.flush():
        out += MARK[line.stream] + line.data + b"\n" + NO_NEWLINE
    return bytes(out)


def parse_since(text: str | None) -> datetime.datetime | None:
    """--since: an ISO 8601 time (local when it has no zone) or an age like 30s, 10m, 2h, 1d."""
    if text is None:
        return None
    m = _AGO.match(text.strip())
    if m:
        seconds = float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
        try:
            return datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=seconds)
        except OverflowError:   # (before the year 1: everything kept)
            return datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
    try:
        when = datetime.datetime.fromisoformat(text.strip())
    except ValueError:
        raise click.BadParameter(f"{text!r}: give an ISO time (2026-11-29T14:00:00) or an age (30s, 10m, 2h, 1d)",
                                 param_hint="--since") from None
    return when if when.tzinfo else when.astimezone()


_OUT: Terminal | None = None


def _write(data: bytes) -> None:
    """To stdout: escaped on a terminal (sandbox bytes and tenant names are never obeyed), exact otherwise."""
    global _OUT
    if _OUT is None:
        _OUT = Terminal(sys.stdout.buffer)
    _OUT.write(data)


async def _show(bus: Bus, rec: TrajRecord, seq: int, fmt: str, job: str | None) -> None:
    """Write one trajectory record (an exec's with its output) as replay prints it."""
    if fmt == "json":
        _write(msgspec.json.encode({"seq": seq, **msgspec.to_builtins(rec)}) + b"\n")
        if rec.type == "exec":
            out = await _output(bus, rec)
            if not out.kept_only:   # the trajectory record above already holds the part it kept
                for record in (out.start, *out.chunks, out.exit):
                    if record is not None:
                        _write(encode(record) + b"\n")
            if out.kept_only or out.aged_out() > 0:   # (a reader must not take what is left for all)
                gone = {"kind": "aged_out", "exec_id": rec.exec_id, "kept_only": out.kept_only,
                        "records": out.aged_out()}
                _write(msgspec.json.encode(gone) + b"\n")
    elif rec.type != "exec":
        stamp = time.strftime("%H:%M:%S", time.localtime(rec.at))
        _write(f"# {stamp} {rec.sandbox_id} {rec.type}{': ' + one_line(rec.detail) if rec.detail else ''}\n"
               .encode(errors="surrogateescape"))
        for d in rec.decisions:        # a network record: the proxy's decisions, one a line
            where = f"{d.get('name') or d.get('address', '')}:{d.get('port', 0)}"
            said = d.get("reason") or f"{d.get('bytes_out', 0)} B out, {d.get('bytes_in', 0)} B in"
            _write(f"#   {d.get('verdict', '?')} {one_line(where)} ({one_line(str(said))})\n".encode(errors="replace"))
        if rec.suppressed:
            _write(f"#   and {sum(v for k, v in rec.suppressed.items() if k != 'bytes')} more, only counted "
                   f"({rec.suppressed.get('bytes', 0)} B)\n".encode())
    else:
        out = await _output(bus, rec)
        how = ", ".join(([f"sandbox {rec.sandbox_id} of {rec.tenant}"] if job else [])   # (a job's commands:
                        + ([f"as {one_line(rec.user)}"] if rec.user else [])       # many sandboxes, and with
                        + ([f"in {one_line(rec.cwd)}"] if rec.cwd else []))        # an operator's, tenants)
        _write(f"$ {_command(rec)}\n".encode(errors="surrogateescape")
               + (f"#   ({how})\n".encode(errors="surrogateescape") if how else b"") + marked(out.chunks))
        if out.kept_only:
            if len(rec.stdout) < rec.stdout_bytes or len(rec.stderr) < rec.stderr_bytes:
                _write(f"# (output aged out of dsec.out: only the first {len(rec.stdout)} of {rec.stdout_bytes}"
                       f" stdout and {len(rec.stderr)} of {rec.stderr_bytes} stderr bytes were kept)\n".encode())
        elif out.aged_out() > 0:
            _write(f"# ({out.aged_out()} output records aged out of dsec.out)\n".encode())
        status = f"exit {rec.exit_code}" + (" (timed out)" if rec.timed_out else "") + \
            (" (output truncated)" if rec.truncated else "") + (f" [{rec.error_code}: {one_line(rec.detail)}]"
                                                                 if rec.error_code else "")
        pid = f", pid {rec.pid}" if rec.pid else ""
        _write(f"# {status}, {rec.ended_at - rec.started_at:.3f}s, cpu {rec.cpu_time:.3f}s{pid}\n".encode())


async def _known(bus: Bus, sandbox_id: str) -> bool:
    """Whether some tenant's sandbox has this id: its record (a tenant's or a project's key) or a trajectory record."""
    where = [(streams.TRAJ_STREAM, subjects.trajectory("*", "*", sandbox_id)),
             *((f"KV_{streams.SANDBOXES_KV}", f"$KV.{streams.SANDBOXES_KV}.{key}.{sandbox_id}") for key in ("*", "*.*"))]
    for stream, subject in where:
        if await bus.held_on(stream, subject):
            return True
    return False


@main.command()
@nats_option
@click.option("--sandbox", "sandbox_id", default=None, help="Replay one sandbox's episode.")
@click.option("--job", default=None, help="Replay every sandbox of a job (its `job` label).")
@click.option("--since", default=None, metavar="TIME",
              help="Start at records written at or after TIME: ISO 8601 (2026-11-29T14:00:00) or an age (10m, 2h).")
@click.option("--seq", type=click.IntRange(min=1), default=None, metavar="N",
              help="Start at DSEC_TRAJ sequence N (json records carry theirs as `seq`).")
@click.option("--follow", is_flag=True,
              help="Keep printing records as they are written (each command when it ends); a --sandbox replay "
                   "stops at the end of its episode (destroyed, expired, failed, node_lost).")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="text: lifecycle lines (# ...), commands ($ ...), their output lines marked by stream "
                   "(1| stdout, 2| stderr) and exit lines; json: one JSON object per line, each trajectory "
                   "record (with its `seq`) followed by the exec's output records as stored on dsec.out.")
@click.option("--speed", type=click.Choice(["instant", "original"]), default="instant", show_default=True,
              help="original: wait between records as long as they were apart when they happened.")
@run_async
async def replay(nats_url: str, sandbox_id: str | None, job: str | None, since: str | None, seq: int | None,
                 follow: bool, fmt: str, speed: str) -> None:
    """Print an episode exactly as it happened: lifecycle, commands, their output byte for byte (from
    dsec.out while it is kept, else the part kept in the trajectory) and exit codes. Works after the
    sandbox is gone and after a restart (the streams are on disk). An operator's command: it reads the streams
    with an admin's or ops' credential (STATE_DIR/creds/admin.creds), not a tenant's (a tenant reads its own
    trajectories with the SDK's client.trajectories()). Give exactly one of --sandbox or --job."""
    if bool(sandbox_id) == bool(job):
        fail("give exactly one of --sandbox ID or --job J")
    if since is not None and seq is not None:
        fail("give --since or --seq, not both")
    try:
        config = consumer_config("*", job, sandbox_id, seq if seq is not None else parse_since(since), None, 30.0)
    except DsecError as exc:
        fail(str(exc))
    bus = await connect(nats_url, "dsec-replay", "ops", reconnect=follow)
    try:
        if follow and sandbox_id and not await _known(bus, sandbox_id):   # (it waited for ever, printing nothing)
            fail(f"no sandbox {sandbox_id}: it has no record and no trajectory records (a wrong id?)")
        previous = None
        count = 0
        async with contextlib.aclosing(read(bus, config, follow)) as items:   # closed here, before the bus
            async for item in items:
                rec = item.record
                await item.ack()
                count += 1
                if speed == "original" and previous is not None and rec.at > previous:
                    await asyncio.sleep(min(rec.at - previous, 60.0))
                previous = rec.at
                await _show(bus, rec, item.seq, fmt, job)
                if follow and sandbox_id and rec.type in ENDS:
                    break
        if count == 0:
            fail(f"no trajectory records for {'sandbox ' + sandbox_id if sandbox_id else 'job ' + str(job)}")
    finally:
        await bus.close()
