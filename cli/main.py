"""The `dsec` command line."""
from __future__ import annotations

import asyncio
import functools
import os
import sys

import click

from bus.errors import DsecError

DEFAULT_URL = os.environ.get("DSEC_NATS", "nats://127.0.0.1:4222")
nats_option = click.option("--nats", "nats_url", default=DEFAULT_URL, show_default=True, metavar="URL",
                           help="NATS server to talk to (env DSEC_NATS).")


def fail(message: str, code: int = 1):
    """Print one clear line to stderr and exit non-zero."""
    click.echo(f"dsec: error: {message}", err=True)
    sys.exit(code)


def run_async(fn):
    """Run an async command; every DsecError becomes one line and exit 1, never a traceback."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return asyncio.run(fn(*args, **kwargs))
        except DsecError as exc:
            fail(str(exc))
        except KeyboardInterrupt:
            fail("interrupted", 130)
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
    from cli import admin, commands, demo, image, replay, top, up, warm  # noqa: F401  (commands attach themselves to `main`)


_register()

if __name__ == "__main__":
    main()
