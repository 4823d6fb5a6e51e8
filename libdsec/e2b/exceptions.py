"""E2B's exception classes, and how DSec's errors map onto them (docs/e2b.md)."""
from __future__ import annotations

from bus import errors


class SandboxException(Exception):
    """Base of every sandbox error."""


class TimeoutException(SandboxException):
    """A request, a command or the sandbox timed out."""


class InvalidArgumentException(SandboxException):
    """An argument is invalid (or names something DSec does not offer)."""


class NotEnoughSpaceException(SandboxException):
    """No space left (the sandbox's disk limit, or no node with room)."""


class NotFoundException(SandboxException):
    """Something was not found."""


class FileNotFoundException(NotFoundException):
    """A file or directory was not found."""


class SandboxNotFoundException(NotFoundException):
    """The sandbox was not found (or has ended)."""


class AuthenticationException(Exception):
    """The credential was refused (like E2B's, not a SandboxException)."""


class TemplateException(SandboxException):
    """The template (DSec image) cannot be used."""


class RateLimitException(SandboxException):
    """A quota or rate limit was hit."""


def mapped(err: errors.DsecError) -> Exception:
    """The E2B exception for one of DSec's errors (its message kept; the original is its __cause__)."""
    text = str(err)
    match err:
        case errors.SandboxNotFound():
            return SandboxNotFoundException(text)
        case errors.FileOpError() if text.startswith(("no such file", "no such directory")):
            return FileNotFoundException(text)
        case errors.FileOpError() if text.startswith(("not a directory", "not a regular file", "is a directory")):
            return InvalidArgumentException(text)   # (as E2B's envd: invalid argument, HTTP 400)
        case errors.ExecFailed() if text.startswith("no such directory"):   # a cwd that is not there (envd's 400)
            return InvalidArgumentException(text)
        case errors.FileOpError() if "quota" in text or "no space" in text:
            return NotEnoughSpaceException(text)
        case errors.ExecTimeout() | errors.RequestExpired():
            return TimeoutException(text)
        case errors.InvalidRequest() | errors.Unsupported():
            return InvalidArgumentException(text)
        case errors.ImageNotFound():
            return TemplateException(text)
        case errors.RateLimited() | errors.QuotaExceeded():
            return RateLimitException(text)
        case errors.CapacityUnavailable():
            return NotEnoughSpaceException(text)
        case errors.AuthenticationFailed() | errors.PermissionDenied():
            return AuthenticationException(text)
    return SandboxException(text)


class Secret:
    """E2B's secrets (values its platform injects into a sandbox, IAM tokens): DSec injects none, so making
    one is refused with this error rather than silently doing nothing."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise InvalidArgumentException("secrets are not offered by DSec: pass values with envs= instead")

    @classmethod
    def iam_token(cls, *args: object, **kwargs: object) -> "Secret":
        raise InvalidArgumentException("IAM tokens are not offered by DSec")


# E2B sandbox calls DSec does not offer: each raises InvalidArgumentException naming itself (docs/e2b.md), as
# the facade's other refusals do, instead of an AttributeError that reads as a bug of the facade.
NOT_OFFERED = {
    "get_host": "a sandbox's ports are not exposed on a public host: reach them from inside (commands)",
    "get_metrics": "per-sandbox metrics are the node's (Prometheus: dsec up --metrics-port)",
    "upload_url": "files go in through files.write", "download_url": "files come out through files.read",
    "sandbox_domain": "a sandbox has no public domain",
}


class NotOffered(InvalidArgumentException, AttributeError):
    """An E2B call DSec does not offer: InvalidArgumentException, and an AttributeError too, so hasattr() and
    getattr(obj, name, default) say it is not there."""


def not_offered(name: str) -> InvalidArgumentException:
    return NotOffered(f"{name} is not offered by DSec: {NOT_OFFERED[name]} (docs/e2b.md)")
