"""The `dsec` command line."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import sys
from typing import NoReturn

import click

from bus.creds import principal_of
from bus.errors import DsecError, PermissionDenied

DEFAULT_URL = os.environ.get("DSEC_NATS", "nats://127.0.0.1:4222")


def _set_creds(_ctx, _param, value):
    if value:
        os.environ["DSEC_CREDS"] = value   # what every connection of this command then uses (bus/iam.py)
    return value


creds_option = click.option("--creds", metavar="FILE", default=None, expose_value=False, callback=_set_creds,
                            is_eager=True,
                            help="Credential file (env DSEC_CREDS; default the one `dsec up` wrote under "
                                 "$DSEC_STATE_DIR, .dsec/creds/: the default tenant's, or admin's for admin commands).")


class Size(click.ParamType):
    """A size: 256Mi, 1G, 512k or a byte count (bytes out); with zero_ok, 0 too (no limit). Checked as the
    command line is read (exit 2), before any connect: a bad size was found only after connecting (so with no
    server, the connect's error hid it) and exited 1 or 125."""

    name = "size"

    def __init__(self, zero_ok: bool = False):
        self.zero_ok = zero_ok

    def convert(self, value, param, ctx) -> int:
        from bus.errors import InvalidRequest
        from libdsec.resources import SIZE, parse_size
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        text = str(value).strip()
        if self.zero_ok and (m := SIZE.match(text)) and float(m.group(1)) == 0:   # 0, 0.0, 0Mi: no limit
            return 0
        hint = "give one like 256Mi, 1G, 512k or a byte count" + (", or 0 for no limit" if self.zero_ok else "")
        try:
            return parse_size(text, "the size")
        except InvalidRequest as exc:
            self.fail(f"{value!r} is {'below 1 byte' if 'positive' in str(exc) else 'not a size'}: {hint}", param, ctx)
        except (OverflowError, ValueError):   # (a number past a float's range: a traceback before)
            self.fail(f"{value!r} is not a size: {hint}", param, ctx)


def nats_option(fn):
    """--nats URL and --creds FILE: where to connect, and as whom."""
    fn = creds_option(fn)
    return click.option("--nats", "nats_url", default=DEFAULT_URL, show_default=True, metavar="URL",
                        help="NATS server to talk to (env DSEC_NATS).")(fn)


def _set_tenant(_ctx, _param, value):
    if value:
        os.environ["DSEC_TENANT"] = value   # whose sandboxes the SDK's client of this command acts on
    return value


def client_options(fn):
    """--nats, --creds and --tenant NAME: whose sandboxes (an operator, with admin's credential, reaches any
    tenant's: one whose credential was revoked left its sandboxes running, beyond anyone's reach)."""
    fn = click.option("--tenant", metavar="NAME", default=None, expose_value=False, callback=_set_tenant,
                      is_eager=True,
                      help="Act on tenant (or TENANT/PROJECT) NAME's sandboxes (env DSEC_TENANT; default: the "
                           "credential's). With admin's credential (--creds .dsec/creds/admin.creds) any "
                           "tenant's, a revoked one's too.")(fn)
    return nats_option(fn)


async def connect(url: str, name: str, principal: str = "admin", reconnect: bool = True):
    """A connection for an operator command, as `principal` (admin, ops) unless --creds / $DSEC_CREDS
    says otherwise."""
    from bus.conn import Bus
    from bus.creds import default_creds
    return await Bus.connect(url, name=name, reconnect=reconnect, creds=default_creds(principal))


def fail(message: str, code: int = 1) -> NoReturn:
    """Print one clear line to stderr and exit non-zero."""
    click.echo(f"dsec: error: {message}", err=True)
    sys.exit(code)


def _whose_hint() -> str:
    """What to do when the server refused a command's credential: name it when it is a tenant's given by
    --creds / $DSEC_CREDS (operator commands then read streams a tenant's account does not have)."""
    path = os.environ.get("DSEC_CREDS", "")
    who = principal_of(path)
    if not who.startswith("tenant:"):
        return ""
    return (f"; the credential given ({path}) is {who}'s, and this command is an operator's: "
            f"use an admin's or ops' (.dsec/creds/admin.creds under the state dir)")


class Interrupted(KeyboardInterrupt):
    """Work ended by a signal other than SIGINT: the command exits 128 + its number, as a shell reports it
    (143 for SIGTERM, 129 for SIGHUP; Ctrl-C's is 130)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


async def _cancelled_by_signals(work):
    """work, cancelled by SIGTERM or SIGHUP as asyncio cancels it at Ctrl-C (so what it made is undone on the way
    out: an exec's command killed, `dsec run`'s sandbox destroyed), then ended as interrupted. Only where the
    signal is at its default (a command that handles one itself, as `dsec up`, sets its own inside)."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    hit: list[int] = []

    def cancel(sig: int) -> None:
        hit.append(sig)
        task.cancel()
    mine = [sig for sig in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(sig) == signal.SIG_DFL]
    for sig in mine:
        loop.add_signal_handler(sig, cancel, sig)
    try:
        return await work
    except asyncio.CancelledError:
        if hit:
            raise Interrupted(hit[0]) from None
        raise
    finally:
        for sig in mine:
            loop.remove_signal_handler(sig)


def run_async(fn):
    """Run an async command; every DsecError becomes one line and exit 1, never a traceback."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if sys.stdout is None:   # (`dsec ls >&-`: an internal AttributeError, or its output lost in silence)
            fail("standard output is closed: give the command somewhere to write (>/dev/null drops it)",
                 125 if fn.__name__ in ("run", "exec_") else 1)
        try:
            return asyncio.run(_cancelled_by_signals(fn(*args, **kwargs)))
        except PermissionDenied as exc:   # (the hint only for the server's refusal, not the SDK's own checks)
            fail(f"{exc}{_whose_hint() if exc.__cause__ is not None else ''}")
        except DsecError as exc:
            fail(str(exc))
        except KeyboardInterrupt as exc:
            signum = getattr(exc, "signum", signal.SIGINT)
            fail(f"interrupted ({signal.Signals(signum).name})" if signum != signal.SIGINT else "interrupted",
                 128 + signum)
        except click.ClickException:   # a usage error found in the body: click prints it (exit 2)
            raise
        except BrokenPipeError:   # our reader left (`dsec replay | head`): quietly, as a shell tool does
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # (the exit's flush too)
            sys.exit(128 + signal.SIGPIPE)
        except OSError as exc:
            fail(f"{exc.strerror or exc} {getattr(exc, 'filename', '') or ''}".strip())
        except Exception as exc:   # a bug: still one line (DSEC_DEBUG=1 shows the traceback)
            if os.environ.get("DSEC_DEBUG"):
                raise
            fail(f"internal error: {exc.__class__.__name__}: {exc} (please report it; DSEC_DEBUG=1 shows details)")
    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """DSec: elastic sandboxes for agent training, with NATS JetStream as the control plane.

    Start a local cluster with `dsec up`, then create sandboxes with `dsec run`, `dsec create`,
    `dsec exec`, or the libdsec SDK.
    """


def _register() -> None:
    from cli import admin, commands, demo, iam, image, imports, replay, snapshots, top, up, warm  # noqa: F401  (commands attach themselves to `main`)


_register()

if __name__ == "__main__":
    main()
