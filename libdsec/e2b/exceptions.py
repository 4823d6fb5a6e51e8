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


# E2B's other exception classes, in its hierarchy, so that code catching them runs: DSec raises none of them (it has
# no git module, template builds, volumes or secrets; an unreachable sandbox is a TimeoutException as before).
class SandboxNotRunningException(TimeoutException):
    """(E2B: the sandbox was killed or reached its timeout.)"""


class SandboxUnreachableException(TimeoutException):
    """(E2B: the sandbox runs but its daemon cannot be reached.)"""


class GitAuthException(AuthenticationException):
    """(E2B's git module: not offered by DSec.)"""


class GitUpstreamException(SandboxException):
    """(E2B's git module: not offered by DSec.)"""


class ServiceBusyException(Exception):
    """(E2B: its API answered 503.)"""


class BuildException(Exception):
    """(E2B's template builds: DSec builds images with `dsec image build` / `dsec image import`.)"""


class FileUploadException(BuildException):
    """(E2B's template builds.)"""


class VolumeException(Exception):
    """(E2B's volumes: not offered by DSec.)"""


class VolumeNotFoundException(NotFoundException):
    """(E2B's volumes.)"""


class VolumePathNotFoundException(NotFoundException):
    """(E2B's volumes.)"""


class SecretException(Exception):
    """(E2B's secrets: not offered by DSec.)"""


class SecretNotFoundException(SecretException):
    """(E2B's secrets.)"""


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
    "Template": "images are built with `dsec image build` or imported with `dsec image import` (docs/images.md)",
    "AsyncTemplate": "images are built with `dsec image build` or imported with `dsec image import` (docs/images.md)",
}


class NotOffered(InvalidArgumentException, AttributeError):
    """An E2B call DSec does not offer: InvalidArgumentException, and an AttributeError too, so hasattr() and
    getattr(obj, name, default) say it is not there."""


def not_offered(name: str) -> InvalidArgumentException:
    return NotOffered(f"{name} is not offered by DSec: {NOT_OFFERED[name]} (docs/e2b.md)")


class _NotOfferedClass:
    """An E2B class DSec does not offer: importable (code importing it runs), and any use of it (making one, or a
    class method such as Template.build) raises NotOffered naming it."""

    _name = ""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise not_offered(self._name)

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__name__ in NOT_OFFERED:   # (a user's subclass of Template is refused as Template)
            cls._name = cls.__name__

    def __class_getitem__(cls, item: object) -> type:
        return cls


class _Refusing(type):
    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise not_offered(cls._name)


class Template(_NotOfferedClass, metaclass=_Refusing):
    """E2B's template builder: not offered (NOT_OFFERED says what instead)."""


class AsyncTemplate(_NotOfferedClass, metaclass=_Refusing):
    """E2B's template builder: not offered (NOT_OFFERED says what instead)."""
