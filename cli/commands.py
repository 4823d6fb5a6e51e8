"""Sandbox commands: run, create, exec, ls, rm."""
from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import sys
import threading

import click

import libdsec
from libdsec.exechandle import left_running
from bus import kinds, subjects
from cli.termsafe import Terminal, field
from cli.main import Size, client_options, fail, main, run_async


def resource_options(fn):
    """--image, --backend, --workspace, --toolkit, --cpu, --memory, --pids, --disk, --ttl, --env, --label,
    --timeout, --priority, --cpu-class, --privileged, --network, --allow."""
    for opt in reversed([
        click.option("--image", default="busybox", show_default=True, help="Base image name[@version]."),
        click.option("--backend", default="container", show_default=True, metavar="KIND",
                     help="Sandbox kind: container, gvisor, ... (a node must run it; `dsec node ls` lists the kinds)."),
        click.option("--workspace", default=None, metavar="NAME[@VERSION]", help="Workspace layer over the base."),
        click.option("--toolkit", default=None, metavar="NAME[@VERSION]", help="Toolkit layer on top."),
        click.option("--cpu", default=1.0, show_default=True, help="Cores."),
        click.option("--memory", default="256Mi", show_default=True, type=Size(), help="Memory (swap capped equal)."),
        click.option("--pids", default=256, show_default=True, help="Max processes."),
        click.option("--disk", default="256Mi", show_default=True, type=Size(), help="Writable layer size."),
        click.option("--ttl", default=600.0, show_default=True, help="Seconds before it is destroyed."),
        click.option("--env", "-e", multiple=True, metavar="K=V", help="Environment of every exec."),
        click.option("--label", "-l", multiple=True, metavar="K=V", help="Labels."),
        click.option("--timeout", default=60.0, show_default=True, help="Seconds to wait for the sandbox."),
        click.option("--priority", type=click.Choice(["latency", "batch"]), default="latency", show_default=True,
                     help="latency goes ahead of queued batch requests; batch may burst to the cloud pool."),
        click.option("--cpu-class", type=click.Choice(["latency", "batch"]), default=None,
                     help="batch: every process at SCHED_IDLE under low cpu shares, so latency sandboxes keep "
                          "their CPU. [default: the priority's]"),
        click.option("--privileged", is_flag=True,
                     help="VM kinds only: commands keep every capability of the guest's own kernel."),
        click.option("--network", type=click.Choice(["none", "mirror-only", "proxied"]), default=None,
                     help="none (default: loopback only), mirror-only (the node's package mirrors) or proxied "
                          "(what --allow lists). [default: none, or proxied with --allow]"),
        click.option("--allow", multiple=True, metavar="ENTRY",
                     help="Proxied network: a host (pypi.org), *.domain, or range (198.51.100.0/24), each with an "
                          "optional :port or :lo-hi (default 80 and 443). Repeatable."),
    ]):
        fn = opt(fn)
    return fn


def pairs(items: tuple[str, ...], what: str) -> dict[str, str]:
    """K=V options to a dict; one clear error for a malformed one."""
    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise click.UsageError(f"--{what} takes K=V, got {item!r}")   # (exit 2, as any bad option)
        out[k] = v
    return out


async def _create(client: libdsec.AsyncClient, *, image, backend, workspace, toolkit, cpu, memory, pids, disk, ttl,
                  env, label, timeout, priority, privileged, network, allow, cpu_class):
    def queued(reason: str) -> None:
        click.echo(f"dsec: queued ({reason}); waiting up to {timeout:.0f}s", err=True)
    return await client.create(image=image, backend=backend, resources=libdsec.Resources(cpu=cpu, memory=memory, pids=pids, disk=disk),
                               ttl=ttl, env=pairs(env, "env"), labels=pairs(label, "label"), timeout=timeout,
                               priority=priority, on_queued=queued, workspace=workspace, toolkit=toolkit,
                               privileged=privileged, network=_network(network, allow), cpu_class=cpu_class)


def _network(mode: str | None, allow: tuple[str, ...]):
    """--network and --allow -> create(network=...); --allow alone means proxied."""
    if allow and mode not in (None, "proxied"):
        raise click.UsageError(f"--allow takes --network proxied, not {mode}")
    if allow or mode == "proxied":
        return libdsec.Network(allow=list(allow))
    return mode or "none"


async def _stream_to_terminal(sb: libdsec.AsyncSandbox, argv: list[str], timeout: float, max_output: int,
                              interactive: bool = False, user: str | None = None, cwd: str | None = None,
                              env: dict[str, str] | None = None) -> int:
    """The command's output on our stdout/stderr as it comes: escaped on a terminal, byte-exact otherwise.
    interactive (-i): our stdin is the command's (else its stdin is empty, and ours is left unread, as
    `docker exec` without -i: a loop reading ids from a file must not lose them to the first exec).
    Interrupted (a signal), the command is killed before we go."""
    cmd = list(argv)   # argv as given, as `docker exec` takes it (one word with a space was run as a shell script)
    limit = max_output
    outs = {"stdout": Terminal(sys.stdout.buffer), "stderr": Terminal(sys.stderr.buffer)}
    stdin = None
    if interactive:
        if not kinds.supports(sb.backend, "live_stdin"):
            fail(f"-i: a {sb.backend} sandbox takes no live stdin", PLATFORM_ERROR)
        stdin = local_stdin()
    handle = await sb._start(cmd, timeout, cwd, env, stdin, limit, keep_output=False, user=user)
    try:
        got = 0
        async for ev in handle.stream(lines=False):
            if isinstance(ev, libdsec.Output):
                outs[ev.stream].write(ev.data)
                got += len(ev.data)
                continue
            for out in outs.values():
                out.close()
            if ev.truncated:   # (at --max-output, or at the node's own cap when that is lower: it said --max-output's)
                click.echo(f"dsec: the command's output was cut after {got:,} bytes (--max-output {limit:,}, or "
                           f"the node's own cap if lower)", err=True)
            if ev.failure_class == "environment":
                click.echo(f"dsec: the node failed under the command ({ev.fault}): retry it in a fresh sandbox", err=True)
            elif ev.fault:
                click.echo(f"dsec: {ev.fault}", err=True)   # (its own: out of memory)
            if ev.timed_out:
                click.echo(f"dsec: command timed out after {timeout}s{left_running(ev.exit_code)}", err=True)
                return 124
            return ev.exit_code
        return 1
    except BaseException:
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(handle.kill(), 5)
        raise
    finally:
        await handle.close()


def local_stdin():
    """Our stdin's bytes as an async iterable (None when it is closed). A daemon thread reads it (a pipe that
    never ends must not hold the process at its exit); once we are going, it stops without a word."""
    try:
        os.fstat(0)
    except OSError:
        return None
    loop = asyncio.get_running_loop()
    pieces: asyncio.Queue[bytes] = asyncio.Queue()
    room = threading.Semaphore(16)   # pieces read ahead at most (a plain call hands each over: a coroutine
                                     # made in this thread and dropped by the loop's close was a warning)

    def reader() -> None:
        while True:
            try:
                data = os.read(0, 1 << 16)
            except OSError:
                data = b""
            while not room.acquire(timeout=1):
                if loop.is_closed():
                    return
            try:
                loop.call_soon_threadsafe(pieces.put_nowait, data)
            except RuntimeError:     # the loop closed: the command ended
                return
            if not data:
                return

    async def gen():
        threading.Thread(target=reader, daemon=True, name="stdin").start()
        while data := await pieces.get():
            room.release()
            yield data
    return gen()


def _no_stray_option(words) -> None:
    """run and exec pass options they do not know on to the command (`dsec run ls -la`), so an option
    misspelt before the command (`--imag`) would become the command itself, its `--` swallowed: no command
    or sandbox id starts with '-', so one that does is refused as the option it is."""
    for word in words:
        if word.startswith("-"):
            raise click.UsageError(f"No such option: {word} (see --help; a command's own options follow it, "
                                   f"after `--` if need be)")


def command_options(fn):
    """The options of the command a run or exec starts (the SDK's exec(user=, cwd=, env=))."""
    for opt in reversed([
        click.option("--user", "-u", default=None, metavar="USER[:GROUP]",
                     help="Run it as this user of the image (a name or uid, optionally :group). [default: the "
                          "image's User, else root]"),
        click.option("--workdir", "-w", default=None, metavar="DIR",
                     help="Its working directory. [default: the image's WorkingDir, else /]"),
    ]):
        fn = opt(fn)
    return fn


@main.command(context_settings={"ignore_unknown_options": True})
@client_options
@resource_options
@click.option("--exec-timeout", default=600.0, show_default=True, help="Seconds the command may run.")
@click.option("--max-output", default="16Mi", show_default=True, type=Size(),
              help="Output kept past this is cut (said on stderr).")
@click.option("-i", "--interactive", is_flag=True, help="Our stdin is the command's (else it reads nothing).")
@command_options
@click.argument("argv", nargs=-1, type=click.UNPROCESSED)
@run_async
async def run(nats_url, exec_timeout, max_output, interactive, user, workdir, argv, **options) -> None:
    """Create a sandbox, run ARGV in it streaming its output, destroy it, exit with its exit code. Without
    ARGV: the image's Entrypoint and Cmd (an imported image's config).

    Exits with the command's exit code; 124 when it timed out, 125 when DSec could not run it (its error on
    stderr), as `docker run` does, 127 when the command is not found and 126 when it cannot be executed.

    Example: dsec run --image busybox -- sh -c 'echo hi; exit 3'
    """
    _no_stray_option(argv[:1])
    with platform_errors():
        await _run(nats_url, exec_timeout, max_output, interactive, argv, options, user, workdir)


async def _run(nats_url, exec_timeout, max_output, interactive, argv, options, user, workdir) -> None:
    async with libdsec.AsyncClient(nats_url) as client:
        sb = await _create(client, **options)
        try:
            if not argv:
                rec = await client._record(sb.id)
                argv = tuple(rec.command if rec is not None else ())
            if not argv:
                click.echo(f"dsec: error: image {options['image']} has no Entrypoint or Cmd: give the command to run",
                           err=True)
                code = 2
            else:
                code = await _stream_to_terminal(sb, list(argv), exec_timeout, max_output, interactive, user, workdir)
        finally:
            try:
                await sb.destroy()
            except libdsec.DsecError:
                pass
    sys.exit(code)


@main.command()
@client_options
@resource_options
@run_async
async def create(nats_url, **options) -> None:
    """Create a sandbox and print its id."""
    async with libdsec.AsyncClient(nats_url) as client:
        sb = await _create(client, **options)
        click.echo(sb.id)


@main.command(name="exec", context_settings={"ignore_unknown_options": True})
@client_options
@click.option("--timeout", default=600.0, show_default=True, help="Seconds the command may run.")
@click.option("--max-output", default="16Mi", show_default=True, type=Size(),
              help="Output kept past this is cut (said on stderr).")
@click.option("-i", "--interactive", is_flag=True, help="Our stdin is the command's (else it reads nothing).")
@command_options
@click.option("--env", "-e", multiple=True, metavar="K=V", help="Environment of this command (over the sandbox's).")
@click.argument("sandbox_id")
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED)
@run_async
async def exec_(nats_url, timeout, max_output, interactive, user, workdir, env, sandbox_id, argv) -> None:
    """Run ARGV in sandbox SANDBOX_ID, streaming its output; exit with its exit code. With -i our stdin is
    the command's; interrupted (Ctrl-C, SIGTERM, SIGHUP), the command is killed.

    Exits with the command's exit code; 124 when it timed out, 125 when DSec could not run it (no such
    sandbox, a bad request: its error on stderr), as `docker exec` does; 127 when the command is not found
    and 126 when it cannot be executed, as a shell says.

    Example: dsec exec --timeout 30 "$id" -- sh -c 'hostname'; echo hi | dsec exec -i "$id" -- cat;
    dsec exec -u root -w /tmp -e DEBUG=1 "$id" -- id
    """
    _no_stray_option((sandbox_id, *argv[:1]))
    variables = pairs(env, "env") or None
    with platform_errors():
        async with libdsec.AsyncClient(nats_url) as client:
            sb = await client.get(sandbox_id)
            code = await _stream_to_terminal(sb, list(argv), timeout, max_output, interactive, user, workdir,
                                             variables)
    sys.exit(code)


PLATFORM_ERROR = 125   # exec and run: DSec could not run the command (the command's own codes are 0-255 else)


@contextlib.contextmanager
def platform_errors():
    """DSec's errors as exit 125, so a command's own exit 1 is not read as one; a command that could not
    start as a shell says it: 127 when it is not found, 126 when it cannot be executed."""
    try:
        yield
    except libdsec.ExecFailed as exc:
        text = str(exc)
        fail(text, 127 if "command not found: " in text else
             126 if ("permission denied: " in text or "cannot execute " in text) else PLATFORM_ERROR)
    except libdsec.DsecError as exc:
        fail(str(exc), PLATFORM_ERROR)


@main.command(name="ls")
@client_options
@click.option("--all", "all_states", is_flag=True, help="Include destroyed, expired and failed sandboxes.")
@run_async
async def ls(nats_url, all_states) -> None:
    """List sandboxes (with a tenant's credential, its projects' too, in a PROJECT column)."""
    async with libdsec.AsyncClient(nats_url) as client:
        recs = await client.list(all_states)
    projects = any(r.tenant != client.tenant for r in recs)
    click.echo(f"{'ID':<20} {'STATE':<10} {'KIND':<10} {'NODE':<12} {'IMAGE':<14} {'NETWORK':<12} {'CREATED':<20} "
               + ("EXPIRES  PROJECT" if projects else "EXPIRES"))
    for r in recs:
        created = datetime.datetime.fromtimestamp(r.created_at).strftime("%Y-%m-%d %H:%M:%S")
        paused = r.state == "ready" and r.suspended   # (it showed `ready`, with the expiry its pause moves on)
        expires = datetime.datetime.fromtimestamp(r.expires_at).strftime("%H:%M:%S") \
            if r.expires_at and not paused else "-"
        owner = field(subjects.display_name(r.tenant)) if r.tenant != client.tenant else "-"
        state = "suspended" if paused else r.state
        click.echo(f"{field(r.sandbox_id):<20} {state:<10} {field(r.backend):<10} {field(r.node):<12} {field(r.image):<14} {r.network.summary():<12} {created:<20} "
                   + (f"{expires:<8} {owner}" if projects else expires))


async def _each(nats_url: str, sandbox_ids, act) -> None:
    """act(sandbox) on each sandbox given, printing its id; exit 1 if any was not found."""
    failed = 0
    async with libdsec.AsyncClient(nats_url) as client:
        for sid in sandbox_ids:
            try:
                await act(await client.get(sid))
                click.echo(sid)
            except libdsec.SandboxNotFound as exc:
                click.echo(f"dsec: error: {exc}", err=True)
                failed += 1
    if failed:
        sys.exit(1)


def _per_sandbox(name: str, doc: str, method: str) -> None:
    """`dsec NAME ID...`: sandbox.METHOD() on each."""
    async def command(nats_url, sandbox_ids) -> None:
        await _each(nats_url, sandbox_ids, lambda sb: getattr(sb, method)())
    command.__doc__ = doc
    main.command(name=name)(client_options(click.argument("sandbox_ids", nargs=-1, required=True)(run_async(command))))


_per_sandbox("rm", "Destroy sandboxes.", "destroy")
_per_sandbox("suspend", "Freeze sandboxes: their processes stop, their TTL stops counting (`dsec ls` says suspended).",
             "suspend")
_per_sandbox("resume", "Resume suspended sandboxes: their processes go on where they were.", "resume")


@main.command()
@click.option("--cycles", default=100, show_default=True, type=click.IntRange(1, 100_000),
              help="Cycles per level: sequential, then 8 and 32 in flight (those run at least 4 per slot: 32, 128).")
@click.option("--raw", default=100, show_default=True, type=click.IntRange(1, 100_000),
              help="Raw `unshare` baseline launches.")
@click.option("--nats", "nats_url", default=None, metavar="URL",
              help="Measure a running `dsec up` (default: start one on free ports).")
@click.option("--creds", default=None, metavar="FILE", envvar="DSEC_CREDS",
              help="With --nats: the tenant credential to measure with (env DSEC_CREDS; default the one `dsec up` "
                   "wrote under $DSEC_STATE_DIR, .dsec/creds/).")
def bench(cycles: int, raw: int, nats_url: str | None, creds: str | None) -> None:
    """Benchmark create -> exec `true` -> destroy against a raw `unshare` launch (same as python -m bench.cycle)."""
    from bench.cycle import main as run_bench
    if creds:
        os.environ["DSEC_CREDS"] = creds   # (the SDK's client reads it)
    try:
        run_bench(cycles, raw, nats_url)
    except libdsec.DsecError as exc:
        fail(str(exc))
