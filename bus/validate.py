"""Request validation: a create request or warm pool is checked field by field (by placement and again by
the edge that takes it); errors name the field."""
from __future__ import annotations

import math
import posixpath
import re
import time
import urllib.parse

from bus import kinds, network, subjects
from bus.errors import InvalidRequest
from bus.callwire import CallRequest
from bus.messages import CreateRequest, Resources
from bus.records import WarmPool

MIN_MEMORY = 8 << 20
MIN_DISK = 1 << 20
MAX_TTL = 7 * 24 * 3600.0
# A sandbox's most tasks: a node's sandboxes share a part of the host's (edge/backends/hosttables.node_tasks:
# 77,000 on this 24 GiB host), and 4,194,304 let one take the host's pid_max whole (helper A2)
MAX_PIDS = 1 << 14
MAX_WAIT = 1800.0   # a create may wait this long for room; well inside the request streams' max age
MAX_WARM_POOL = 64   # the largest `max` of a warm pool (sandboxes per edge)
MAX_CALL = Resources(cpu=4.0, memory=4 << 30, pids=4096, disk=1 << 30)   # the most one fncall may ask for
MAX_CALL_TIMEOUT = 600.0
MAX_CALL_OUTPUT = 256 << 10     # bytes kept per stream of a call (its reply is one bus message)
MAX_CALL_FILES = 600_000        # bytes of files given with a call, and again of files read back
MAX_READ_BACK = 1000           # paths one call may read back
MAX_CALL_ANSWER = 720 << 10    # bytes of output and files read back in a call's answer (one bus message, base64)
MAX_ARG_STRLEN = 131072         # Linux: bytes one argv word or "NAME=value" env entry may hold, its NUL included
MAX_LABELS = 16 << 10           # bytes of a sandbox's labels, keys and values (its record carries them)


def seconds(value, what: str, *, zero: bool = False) -> float:
    """A finite number of seconds, > 0 (>= 0 with zero); InvalidRequest naming `what` otherwise (a bool, a
    string, NaN or infinity: JSON has no infinity, so it reached the server as null)."""
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
            or not (value >= 0 if zero else value > 0)):
        raise InvalidRequest(f"{what} must be a {'non-negative' if zero else 'positive'} finite number of seconds, "
                             f"got {value!r}")
    return float(value)


def nats_url(url: str) -> str:
    """One NATS server URL as nats-py takes it (nats://, tls://, ws://, wss:// or a bare HOST:PORT); InvalidRequest
    otherwise (a URL like `bogus://x` waited for the connect's timeout, then said it could not connect)."""
    parts = urllib.parse.urlsplit(url if "://" in url else f"nats://{url}")
    try:
        parts.port
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("nats", "tls", "ws", "wss") or not parts.hostname or any(
            c.isspace() for c in url):
        raise InvalidRequest(f"not a NATS server URL: {url!r} (nats://HOST:PORT)")
    return url


def file_path(path, what: str = "path") -> str:
    """A path inside a sandbox as a file operation takes it: absolute, without NUL; InvalidRequest otherwise
    (checked by the SDK, and by the node again)."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise InvalidRequest(f"{what} must be absolute (start with /): {path!r}")
    if "\0" in path:
        raise InvalidRequest(f"{what} must not hold a NUL byte: {path!r}")
    return path


def check_resources(r: Resources) -> None:
    """Plain range checks (node maximums are checked by scoring)."""
    if not r.cpu > 0 or r.cpu > 1024:
        raise InvalidRequest(f"resources.cpu must be > 0 and <= 1024 cores, got {r.cpu}")
    if r.memory < MIN_MEMORY:
        raise InvalidRequest(f"resources.memory must be at least {MIN_MEMORY >> 20}Mi, got {r.memory} bytes")
    if r.pids < 1 or r.pids > MAX_PIDS:
        raise InvalidRequest(f"resources.pids must be between 1 and {MAX_PIDS}, got {r.pids}")
    if r.disk < MIN_DISK:
        raise InvalidRequest(f"resources.disk must be at least 1Mi, got {r.disk} bytes")


def check_create(req: CreateRequest, now: float | None = None) -> None:
    """Every field of a create request that placement relies on."""
    for value, what in ((req.request_id, "request_id"), (req.sandbox_id, "sandbox_id"), (req.tenant, "tenant")):
        try:
            subjects.token(value, what)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
    network.check(req.network)
    kinds.check_create_kind(req.backend, bool(req.snapshot), req.privileged, req.network.mode != "none")
    if not req.deadline > 0:
        raise InvalidRequest("deadline must be an absolute unix time")
    if req.deadline > (now or time.time()) + MAX_WAIT:
        raise InvalidRequest(f"deadline: a create may wait at most {int(MAX_WAIT)} s (timeout too large)")
    if not 0 < req.ttl <= MAX_TTL:
        raise InvalidRequest(f"ttl must be > 0 and <= {int(MAX_TTL)} seconds, got {req.ttl}")
    if not subjects.is_reply_subject(req.reply_to):
        raise InvalidRequest("reply_to must be a reply subject (dsec.reply.<tenant>.<...> or _INBOX.<...>)")
    check_env(req.env)
    check_labels(req.labels)
    check_resources(req.resources)
    least = kinds.MIN_MEMORY.get(req.backend, 0)
    if req.resources.memory < least:
        raise InvalidRequest(f"resources.memory: a {req.backend} sandbox needs at least {least >> 20}Mi "
                             f"(its guest kernel), got {req.resources.memory >> 20}Mi")
    if req.resources.disk < kinds.MIN_DISK.get(req.backend, 0):
        raise InvalidRequest(f"resources.disk: a {req.backend} sandbox's writable disk is at least "
                             f"{kinds.MIN_DISK[req.backend] >> 20}Mi (its own ext4 image), got {req.resources.disk} bytes")
    fewest = kinds.MIN_PIDS.get(req.backend, 1)
    if req.resources.pids < fewest:
        raise InvalidRequest(f"resources.pids: a {req.backend} sandbox needs at least {fewest} (its guest agent "
                             f"forks beside each command), got {req.resources.pids}")


def check_labels(labels: dict[str, str]) -> None:
    """A sandbox's labels: str keys (non-empty) and values, MAX_LABELS bytes in all. Every write of its record
    carries them, and a record larger than the NATS server takes could never be stored: its sandbox would
    run with no record of it."""
    size = 0
    for k, v in labels.items():
        if not isinstance(k, str) or not k or not isinstance(v, str):
            raise InvalidRequest(f"labels: keys must be non-empty strings and values strings, got {k!r}")
        size += len(k.encode("utf-8", "surrogatepass")) + len(v.encode("utf-8", "surrogatepass"))
    if size > MAX_LABELS:
        raise InvalidRequest(f"labels: {size:,} bytes of keys and values; at most {MAX_LABELS:,}")


def check_env(env: dict[str, str]) -> None:
    """Names and values execve can take (a name with '=' would silently set another variable)."""
    for k, v in env.items():
        if not isinstance(k, str) or not k or "=" in k or "\0" in k:
            raise InvalidRequest(f"env: invalid variable name {k!r}")
        if not isinstance(v, str) or "\0" in v:
            raise InvalidRequest(f"env: the value of {k} must be a string without NUL bytes")
        _check_length(f"env: {k}", k, "=", v)
        _check_text(f"env: {k!r}", k + v)


def _check_length(field: str, *parts: str) -> None:
    """InvalidRequest when the word made of parts is too long for execve (its UTF-8 bytes; encoded only when
    it may be: a character is at most 4 bytes)."""
    if sum(map(len, parts)) * 4 < MAX_ARG_STRLEN:
        return
    size = sum(len(part.encode("utf-8", "surrogatepass")) for part in parts)
    if size >= MAX_ARG_STRLEN:
        raise InvalidRequest(f"{field} is {size:,} bytes; Linux takes at most {MAX_ARG_STRLEN - 1:,} in one "
                             "argument or environment entry (MAX_ARG_STRLEN): pass long data as stdin or a file")


def check_exec_words(argv: list[str], env: dict[str, str], cwd: str, shell: str = "", user: str = "") -> None:
    """An exec's argv (or shell script), env and cwd as execve takes them; InvalidRequest naming the field
    (checked by the SDK before sending and by the node again: a NUL byte made a container's exec fail as a
    node error, and a word too long failed as each backend put it, gVisor's as "File name too long")."""
    if any("\0" in a for a in argv):
        raise InvalidRequest("argv must not contain NUL bytes")
    for i, word in enumerate(argv):
        _check_length(f"argv[{i}]", word)
        _check_text(f"argv[{i}]", word)
    _check_length("the shell script (one argument of sh -c)", shell)
    _check_text("the shell script", shell)
    check_env(env)
    if "\0" in cwd:
        raise InvalidRequest("cwd must not contain NUL bytes")
    _check_text("cwd", cwd)
    if "\0" in user:   # (it failed as ExecFailed, from the backend)
        raise InvalidRequest("user must not contain NUL bytes")
    _check_text("user", user)


def _check_text(field: str, text: str) -> None:
    """InvalidRequest when text holds what is no character (a byte of a name that is not UTF-8, as Python
    carries one, a lone surrogate): the wire carries text, and encoding it failed as an internal error."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest(f"{field} is not valid UTF-8 text ({text[:60]!r})") from None


def expired(deadline: float, now: float | None = None) -> bool:
    """Whether an absolute deadline has passed."""
    return (now or time.time()) > deadline


def check_warm_pool(spec: WarmPool) -> None:
    """Range checks of a warm pool's settings."""
    if not subjects.is_token(spec.name):
        raise InvalidRequest(f"name: {spec.name!r} is not a valid pool name (letters, digits, - and _)")
    if not 0 <= spec.min <= spec.max <= MAX_WARM_POOL:
        raise InvalidRequest(f"min and max must satisfy 0 <= min <= max <= {MAX_WARM_POOL}, "
                             f"got {spec.min} and {spec.max}")
    if not subjects.is_token(spec.node_pool):
        raise InvalidRequest(f"node_pool: {spec.node_pool!r} is not a valid pool name")
    kinds.check_kind(spec.backend)
    kinds.require(spec.backend, "warm_pools", "warm pools")
    check_resources(spec.resources)


CALL_SCRATCH = ("/tmp/", "/dev/shm/")   # where a call's files may be (a worker's root is read-only)


def check_call(req: CallRequest) -> None:
    """Every field of a call the node relies on; InvalidRequest naming the field."""
    for value, what in ((req.call_id, "call_id"), (req.tenant, "tenant")):
        try:
            subjects.token(value, what)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
    if bool(req.shell) == bool(req.argv):
        raise InvalidRequest("give cmd as a string (trusted shell) or a non-empty argv list, not both or neither")
    if req.argv and not (req.argv[0] and all(isinstance(a, str) and "\0" not in a for a in req.argv)):
        raise InvalidRequest("argv must be strings without NUL bytes, the first not empty")
    if "\0" in req.shell:
        raise InvalidRequest("cmd must not contain NUL bytes")
    if not 0 < req.timeout <= MAX_CALL_TIMEOUT:
        raise InvalidRequest(f"timeout must be > 0 and <= {MAX_CALL_TIMEOUT:.0f} seconds, got {req.timeout}")
    check_resources(req.resources)
    r, m = req.resources, MAX_CALL
    if r.cpu > m.cpu or r.memory > m.memory or r.pids > m.pids or r.disk > m.disk:
        raise InvalidRequest(f"resources: a call may ask for at most cpu={m.cpu:g}, memory={m.memory >> 20}Mi, "
                             f"pids={m.pids}, disk={m.disk >> 20}Mi")
    for path in [*req.files, *req.read_back, req.cwd]:
        if not path.startswith("/") or "\0" in path:
            raise InvalidRequest(f"paths must be absolute, got {path!r}")
    for path in [*req.files, *req.read_back]:   # (refused after the command ran, as an environment failure: G)
        if not posixpath.normpath(path).startswith(CALL_SCRATCH):
            raise InvalidRequest(f"files and read_back: a worker's files live under /tmp or /dev/shm (its root is "
                                 f"read-only), got {path!r}")
    if len(req.read_back) > MAX_READ_BACK:   # (each unread one's reason takes room in the one answer)
        raise InvalidRequest(f"read_back: at most {MAX_READ_BACK} paths, got {len(req.read_back)}")
    if sum(len(d) for d in req.files.values()) > MAX_CALL_FILES:
        raise InvalidRequest(f"files: at most {MAX_CALL_FILES} bytes with one call")
    if not 0 < req.max_output <= MAX_CALL_OUTPUT:
        raise InvalidRequest(f"max_output must be > 0 and <= {MAX_CALL_OUTPUT}, got {req.max_output}")
    check_env(req.env)


_TAG = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_SNAPSHOT_ID = re.compile(r"^snap[0-9a-f]{16}$")


def check_tag(tag) -> None:
    """A snapshot's tag: "" (none), or 1-128 of letters, digits, `_.:-`, and not shaped like a snapshot id
    (an id wins a lookup, so such a tag named another snapshot, or none, once that id was gone). A newline
    in one split `dsec snapshot ls` rows (helper C)."""
    if tag == "":
        return
    if not isinstance(tag, str) or not _TAG.fullmatch(tag) or _SNAPSHOT_ID.fullmatch(tag):
        shown = repr(tag) if len(repr(tag)) <= 60 else repr(tag)[:57] + "..."
        raise InvalidRequest(f"tag must be 1-128 of letters, digits and _.:- and not a snapshot id, got {shown}")

