"""Which credential a client connects with, and what it holds: the client's side of bus/iam.py (a DSec
credential file is an nkey user seed, decorated as nsc decorates one; nsc's JWT .creds work too)."""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

from bus.errors import AuthenticationFailed


def creds_path(root: Path, principal: str) -> Path:
    """Where a state dir keeps a principal's credential: creds/<role>.creds, creds/tenants/<tenant>.creds."""
    if principal.startswith("tenant:"):
        return root / "creds" / "tenants" / f"{principal[7:]}.creds"
    return root / "creds" / f"{principal}.creds"


def seed_of(text: str) -> str | None:
    """The user seed in a credential file's text (ours, nsc's .creds, or a bare seed); None if there is none."""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("SU") and re.fullmatch(r"SU[A-Z2-7]{56}", line):
            return line
    return None


_EXPIRES = re.compile(r"^# Expires: (\S+) \(unix (\d+(?:\.\d+)?)\)", re.M)


def iso_time(at: float) -> str:
    """A unix time as the credentials and `dsec iam ls` write it (UTC, to the second)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


def expires_line(at: float) -> str:
    """The header line a credential with an expiry carries (the server stops accepting it then: bus/iam.py)."""
    return f"# Expires: {iso_time(at)} (unix {at:.0f})\n"


def expiry_of(text: str) -> tuple[float, str] | None:
    """(unix time, ISO time) a DSec credential expires at, or None when it does not."""
    m = _EXPIRES.search(text)
    return (float(m.group(2)), m.group(1)) if m else None


def _expired_text(text: str) -> str:
    found = expiry_of(text)
    return f"expired at {found[1]}" if found and found[0] <= time.time() else ""


def expired(creds: str | None) -> str:
    """'' while a credential file is valid (or cannot be read); else 'expired at <ISO time>'."""
    try:
        return _expired_text(open(creds).read()) if creds else ""
    except OSError:
        return ""


def credential_options(creds: str | None) -> dict:
    """nats.connect's options for a credential file; AuthenticationFailed when it is missing, expired or
    holds neither an nkey seed nor a user JWT."""
    if not creds:
        return {}
    try:
        text = Path(creds).read_text()
    except OSError as exc:
        raise AuthenticationFailed(f"credential {creds} cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:   # (binary garbage: an internal error before, helper C)
        raise AuthenticationFailed(f"credential {creds} is malformed: not a text credential file") from None
    why = _expired_text(text)
    if why:
        raise AuthenticationFailed(f"credential {creds} {why}: ask for a new one (`dsec iam creds issue`)")
    if "BEGIN NATS USER JWT" in text:
        return {"user_credentials": creds}
    seed = seed_of(text)
    if seed is None:
        raise AuthenticationFailed(f"credential {creds} is malformed: it holds no nkey user seed (SU...) "
                                   f"or user JWT")
    return {"nkeys_seed_str": seed}


def state_dir() -> Path:
    return Path(os.environ.get("DSEC_STATE_DIR", ".dsec"))


def default_creds(principal: str) -> str | None:
    """The credential a client uses when given none: $DSEC_CREDS, else the one `dsec up` wrote under
    $DSEC_STATE_DIR (default .dsec/) for this principal (`tenant:<name>`, `admin`, `ops`, ...), else none
    (a server without auth)."""
    if os.environ.get("DSEC_CREDS"):
        return os.environ["DSEC_CREDS"]
    path = creds_path(state_dir().resolve(), principal)
    return str(path) if path.exists() else None


def creds_principal(text: str) -> str:
    """The principal a DSec credential file names in its header ("" when it names none)."""
    m = re.search(r"^# DSec credential for (\S+)\.", text, re.M)
    return m.group(1) if m else ""


def principal_of(path: str | None) -> str:
    """The principal a DSec credential file names ("" without one, or for a file naming none)."""
    if not path:
        return ""
    try:
        return creds_principal(Path(path).read_text())
    except (OSError, UnicodeDecodeError):
        return ""


def tenant_of_creds(path: str) -> str | None:
    """The tenant a DSec tenant credential names (None for another principal's, or an unreadable file:
    connecting says what is wrong with it)."""
    principal = principal_of(path)
    return principal[7:] if principal.startswith("tenant:") else None


def running_state_dirs(url: str) -> list[str]:
    """The state dirs of the `dsec up` processes on this host serving url's port (absolute paths), for an
    error that can say where their credentials are. Read from /proc: only when a connection was refused."""
    from urllib.parse import urlsplit
    try:
        split = urlsplit(url)
        port, host = split.port or 4222, split.hostname or ""
    except ValueError:
        return []
    if host not in ("127.0.0.1", "localhost", "::1", ""):
        return []
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\0")[:-1]
            at = next(i for i, a in enumerate(argv[:-1]) if os.path.basename(a) == "dsec" and argv[i + 1] == "up")
            opts = _options(argv[at + 2:])
            if int(opts.get("--port", 4222)) != port:
                continue
            env = dict(e.split("=", 1) for e in open(f"/proc/{pid}/environ", "rb").read().decode(
                errors="replace").split("\0") if "=" in e)
            state = opts.get("--state-dir") or env.get("DSEC_STATE_DIR", ".dsec")
            found.append(os.path.normpath(os.path.join(os.readlink(f"/proc/{pid}/cwd"), state)))
        except (OSError, StopIteration, ValueError):
            continue
    return sorted(set(found))


def _options(args: list[str]) -> dict[str, str]:
    """--name value and --name=value pairs of a command line."""
    out = {}
    for i, a in enumerate(args):
        if a.startswith("--") and "=" in a:
            name, _, value = a.partition("=")
            out[name] = value
        elif a.startswith("--") and i + 1 < len(args):
            out[a] = args[i + 1]
    return out
