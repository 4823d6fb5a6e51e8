"""What a command's trajectory record keeps, so that the record always fits in one bus message.

An exec request may carry up to the server's max_payload (1 MiB) of argv, and the record kept two streams'
first --traj-output bytes (base64 in JSON) besides: an exec of 900 KB of arguments made a 1.08 MB record
that the NATS server refused. Its node's outbox then tried it again forever, and every later change of that
sandbox, its `destroyed` included, waited behind it: the sandbox read `ready` after it was gone. The command
is now kept up to TRAJ_COMMAND bytes (`command_cut`, with the size and sha256 of what was sent), env names
and cwd up to their own budgets; a record still larger than TRAJ_MAX keeps no output (`truncated`: dsec.out
has all of it while it is kept).
"""
from __future__ import annotations

import hashlib

import msgspec

from bus.messages import encode
from bus.records import TrajRecord

TRAJ_COMMAND = 64 << 10    # bytes of a command (argv words, or a shell script) a record keeps
TRAJ_NAMES = 16 << 10      # bytes of env names a record keeps
TRAJ_TEXT = 4 << 10        # bytes of cwd and of a watch's path (PATH_MAX), and of detail, a record keeps
TRAJ_MAX = 900 << 10       # the most one encoded record may take (the server's max_payload: 1 MiB)


def _cut(text: str, budget: int) -> str:
    """text's longest prefix of at most budget UTF-8 bytes (never half a character)."""
    raw = text.encode("utf-8", "surrogatepass")
    return text if len(raw) <= budget else raw[:budget].decode("utf-8", "ignore")


def _words(words: list[str], budget: int) -> list[str]:
    """The first words within budget bytes in all (the one that crosses it cut)."""
    kept: list[str] = []
    used = 0
    for word in words:
        room = budget - used - 1          # (its NUL)
        if room < 0:
            break
        kept.append(_cut(word, room))
        if kept[-1] != word:
            break                         # cut: the words after it are not kept
        used += len(word.encode("utf-8", "surrogatepass")) + 1
    return kept


def command_digest(argv: list[str], shell: str) -> tuple[int, str]:
    """(bytes, sha256 hex) of a command as sent: its argv words each ended by a NUL (as /proc/PID/cmdline
    shows them), or its shell script's bytes."""
    raw = shell.encode("utf-8", "surrogatepass") if shell else b"".join(
        w.encode("utf-8", "surrogatepass") + b"\0" for w in argv)
    return len(raw), hashlib.sha256(raw).hexdigest()


_TEXT_FIELDS = ("shell", "cwd", "user", "detail", "watch", "id", "sandbox_id", "tenant", "job", "node", "exec_id",
                "error_code", "failure_class")


def _bound(traj: TrajRecord) -> int:
    """More bytes than encode(traj) takes: its output in base64, each character of its other text as 6 bytes
    (JSON's \\u escape of a control character), 4 KiB for its fixed fields and ids."""
    text = (sum(map(len, traj.argv)) + sum(map(len, traj.env_keys)) + 4 * (len(traj.argv) + len(traj.env_keys))
            + sum(len(getattr(traj, name)) for name in _TEXT_FIELDS))
    return (len(traj.stdout) + len(traj.stderr)) * 4 // 3 + 6 * text + (4 << 10)


def fit(traj: TrajRecord) -> TrajRecord:
    """traj as a record of at most TRAJ_MAX bytes encoded (see the module's docstring)."""
    size, digest = command_digest(traj.argv, traj.shell)
    changes: dict = {}
    if size > TRAJ_COMMAND:
        changes.update(argv=_words(traj.argv, TRAJ_COMMAND), shell=_cut(traj.shell, TRAJ_COMMAND),
                       command_cut=True, command_bytes=size, command_sha256=digest)
    if sum(len(k) + 1 for k in traj.env_keys) > TRAJ_NAMES:
        changes["env_keys"] = _words(traj.env_keys, TRAJ_NAMES)
    for name in ("cwd", "user", "detail", "watch"):
        if len(getattr(traj, name)) > TRAJ_TEXT // 4:
            changes[name] = _cut(getattr(traj, name), TRAJ_TEXT)
    if changes:
        traj = msgspec.structs.replace(traj, **changes)
    if _bound(traj) > TRAJ_MAX and len(encode(traj)) > TRAJ_MAX:   # (encoded only when it may not fit: each
        # exec's record is encoded once more to be sent; a command of control characters takes 6 bytes each)
        traj = msgspec.structs.replace(traj, stdout=b"", stderr=b"", truncated=True)
    return traj
