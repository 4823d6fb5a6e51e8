"""Which credential a client connects with, and what it holds: the client's side of bus/iam.py (a DSec
credential file is an nkey user seed, decorated as nsc decorates one; nsc's JWT .creds work too)."""
from __future__ import annotations

import os
import re
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


def credential_options(creds: str | None) -> dict:
    """nats.connect's options for a credential file; AuthenticationFailed when it is missing or holds
    neither an nkey seed nor a user JWT."""
    if not creds:
        return {}
    try:
        text = open(creds).read()
    except OSError as exc:
        raise AuthenticationFailed(f"credential {creds} cannot be read: {exc.strerror or exc}") from None
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


def tenant_of_creds(path: str) -> str | None:
    """The tenant a DSec tenant credential names (None for another principal's, or an unreadable file:
    connecting says what is wrong with it)."""
    try:
        principal = creds_principal(open(path).read())
    except OSError:
        return None
    return principal[7:] if principal.startswith("tenant:") else None
