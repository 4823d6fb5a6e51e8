"""Who an exec runs as: a user of the sandbox's image (`user="name"`, `"uid"`, `"name:group"`, `"uid:gid"`),
resolved from the image's /etc/passwd and /etc/group as a login would (the uid, its primary gid, the groups
that list it, its home), or the sandbox's root (the default; an image's config may name another)."""
from __future__ import annotations

from dataclasses import dataclass

from bus.errors import InvalidRequest
from bus.kinds import ROOT_NAMES

__all__ = ["ExecUser", "ROOT_NAMES", "resolve"]


@dataclass(frozen=True)
class ExecUser:
    """A non-root identity inside the sandbox (its ids are the sandbox's, mapped onto its host range)."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()    # supplementary groups, its primary gid among them (as initgroups does)
    home: str = "/"
    name: str = ""

    def spec(self) -> str:
        """"UID:GID[:GROUP...]", as dsec-enter's flag, the guest agent and its files helper take it."""
        return ":".join(str(i) for i in (self.uid, self.gid, *self.groups))

    def flag(self) -> str:
        """dsec-enter's setup flag: ",u=UID:GID[:GROUP...]"."""
        return ",u=" + self.spec()

    def on_host(self, base: int) -> tuple[int, int, tuple[int, ...]]:
        """Its uid, gid and groups on the host, for a sandbox whose ids start at host id base (fscreds)."""
        return base + self.uid, base + self.gid, tuple(base + g for g in self.groups)


def _table(text: str, width: int) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        fields = line.split(":")
        if len(fields) >= width and fields[0] and not line.startswith("#"):
            rows.append(fields)
    return rows


def _id(text: str, what: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise InvalidRequest(f"user: {what} {text!r} is not a name of the image nor an id in 0-65535")
    return int(text)


def resolve(spec: str, passwd: str, group: str) -> ExecUser | None:
    """spec against the image's passwd and group files: None for root (uid and gid 0)."""
    if spec in ROOT_NAMES:
        return None
    if len(spec) > 256 or "\0" in spec or "\n" in spec:
        raise InvalidRequest("user: too long or holds NUL/newline")
    who, _, grp = spec.partition(":")
    users, groups = _table(passwd, 7), _table(group, 4)
    entry = next((u for u in users if u[0] == who), None)
    if entry is None and not who.isdigit():
        raise InvalidRequest(f"user {who!r} is not in the image's /etc/passwd")
    if entry is None:
        entry = next((u for u in users if u[2] == who), None)
    uid = _id(entry[2], "uid") if entry else _id(who, "uid")
    gid = _id(entry[3], "gid") if entry else 0
    if grp:
        named = next((g for g in groups if g[0] == grp), None)
        if named is None and not grp.isdigit():
            raise InvalidRequest(f"group {grp!r} is not in the image's /etc/group")
        gid = _id(named[2], "gid") if named else _id(grp, "gid")
    if uid == 0 and gid == 0:
        return None
    name = entry[0] if entry else ""
    extra = sorted({gid} | {int(g[2]) for g in groups if name and name in g[3].split(",")
                            and g[2].isdigit() and int(g[2]) <= 65535})   # (one beyond the range is not the user's)
    home = entry[5] if entry and entry[5].startswith("/") else "/"
    return ExecUser(uid=uid, gid=gid, groups=tuple(extra[:64]), home=home, name=name)
