"""The one error tree of DSec. Errors cross the bus as data (code, message) and are rebuilt here by code."""
from __future__ import annotations


class DsecError(Exception):
    """Root of every DSec error."""

    code = "internal"

    def __init__(self, message: str = "", **details: object) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def __str__(self) -> str:
        return self.message or self.__class__.__name__


class BusError(DsecError):
    """The bus failed: connection, timeout or server error."""

    code = "bus"


class BusUnavailable(BusError, ConnectionError):
    """No NATS server answers at the given URL."""

    code = "bus_unavailable"


class AuthenticationFailed(BusError, PermissionError):
    """The NATS server refused the credential: missing, malformed, expired, revoked or unknown (the message
    says which and names the file)."""

    code = "authentication_failed"


class PermissionDenied(BusError, PermissionError):
    """The NATS server refused an operation this credential is not allowed (its account or permissions)."""

    code = "permission_denied"


class InvalidRequest(DsecError, ValueError):
    """A request is malformed or asks for something impossible; the message names the field."""

    code = "invalid_request"


class ImageNotFound(DsecError, LookupError):
    """The image (layer name or version) is not in the store."""

    code = "image_not_found"


class PlacementError(DsecError):
    """The request could not be placed."""

    code = "placement"


class CapacityUnavailable(PlacementError):
    """Nothing could place the request before its deadline."""

    code = "capacity_unavailable"


class QuotaExceeded(PlacementError):
    """The tenant's quota (concurrent sandboxes, total cpu or memory) would be exceeded; never queued."""

    code = "quota_exceeded"


class RateLimited(QuotaExceeded):
    """The tenant sent more control requests than its rate allows; try again shortly."""

    code = "rate_limited"


class RequestExpired(PlacementError, TimeoutError):
    """The request's deadline passed before it was served; it was not started."""

    code = "expired"


class Unsupported(DsecError):
    """The sandbox's backend kind lacks the operation (see bus/kinds.py); refused before anything starts.
    .backend and .operation name them."""

    code = "unsupported"

    @property
    def backend(self) -> str:
        """The kind that lacks it."""
        return str(self.details.get("backend", ""))

    @property
    def operation(self) -> str:
        """The operation refused."""
        return str(self.details.get("operation", ""))


class SandboxError(DsecError):
    """A sandbox operation failed."""

    code = "sandbox"


class _PartialOutput:
    """An error that carries the output received before it (stdout and stderr bytes)."""

    details: dict

    @property
    def stdout(self) -> bytes:
        """Standard output received before the error."""
        return self.details.get("stdout", b"")  # type: ignore[return-value]

    @property
    def stderr(self) -> bytes:
        """Error output received before the error."""
        return self.details.get("stderr", b"")  # type: ignore[return-value]


class SandboxNotFound(_PartialOutput, SandboxError, LookupError):
    """The sandbox does not exist: destroyed, expired, lost or never existed (see .reason). Raised by an exec
    whose sandbox ended under it, it carries the output received before (.stdout, .stderr)."""

    code = "sandbox_not_found"

    @property
    def reason(self) -> str:
        """Why it is gone: destroyed, expired, node_lost, never_existed, ..."""
        return str(self.details.get("reason", "unknown"))

    @classmethod
    def ended(cls, sandbox_id: str, state: str, why: str = "") -> "SandboxNotFound":
        """The error for a sandbox that ended in `state` (or never existed), and why in words when known."""
        return cls(f"sandbox {sandbox_id} not found ({state}{': ' + why if why else ''})", reason=state)


class ExecTimeout(_PartialOutput, SandboxError, TimeoutError):
    """The command did not finish in time; its whole process tree was killed. Carries the output received
    (.stdout, .stderr) and the command's exit code: 137 (SIGKILL) when the timeout killed it, its own when it
    had exited and processes it left running held its output open until the timeout."""

    code = "exec_timeout"

    @property
    def exit_code(self) -> int:
        """The command's exit code (137: the timeout killed it; -1: not known)."""
        return int(self.details.get("exit_code", -1))  # type: ignore[arg-type]

    @property
    def truncated(self) -> bool:
        """Whether output beyond the per-exec cap was dropped."""
        return bool(self.details.get("truncated", False))


class OutputIncomplete(_PartialOutput, SandboxError):
    """An exec's output could not be read whole: parts of it are not in DSEC_OUT (aged out, or the stream
    could not be read before the deadline). Carries what was received (with holes where the missing
    records were) and the missing record seqs."""

    code = "output_incomplete"

    @property
    def missing(self) -> list[int]:
        """Sequence numbers of the output records that could not be read."""
        return list(self.details.get("missing", []))  # type: ignore[call-overload]


class ExecFailed(SandboxError):
    """The command could not be started (e.g. not found inside the sandbox)."""

    code = "exec_failed"


class FileOpError(SandboxError, OSError):
    """A file operation inside a sandbox failed (no such file, too large, ...)."""

    code = "file_error"


class SandboxSuspended(SandboxError):
    """The sandbox is suspended (client.suspend): resume it before running commands in it."""

    code = "sandbox_suspended"


class EnvironmentFailure(SandboxError):
    """The node could not build the sandbox's environment (layer fetch, mount, launch)."""

    code = "environment"


_BY_CODE: dict[str, type[DsecError]] = {}


def _index(cls: type[DsecError]) -> None:
    _BY_CODE[cls.code] = cls
    for sub in cls.__subclasses__():
        _index(sub)


_index(DsecError)


def from_code(code: str, message: str, **details: object) -> DsecError:
    """Rebuild the local error class for a code received from the bus."""
    return _BY_CODE.get(code, DsecError)(message, **details)
