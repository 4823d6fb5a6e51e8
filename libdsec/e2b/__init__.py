"""E2B's Python SDK surface on DSec: code written for E2B runs by changing one import
(`from libdsec.e2b import Sandbox`), or none after `libdsec.e2b.install()` (then `import e2b` is this).

Connection: DSEC_URL (default nats://127.0.0.1:4222) and DSEC_CREDS (a credential file; default the
SDK's own lookup); the tenant is the credential's. docs/e2b.md maps every call and says what is not
offered yet (those raise InvalidArgumentException with one clear line, never silently differ).
"""
from __future__ import annotations

import importlib
import pkgutil
import sys

from libdsec.e2b.exceptions import (AsyncTemplate, AuthenticationException, BuildException, FileNotFoundException,
                                    FileUploadException, GitAuthException, GitUpstreamException,
                                    InvalidArgumentException, NotEnoughSpaceException, NotFoundException,
                                    RateLimitException, SandboxException, SandboxNotFoundException, Secret, Template,
                                    TemplateException, TimeoutException)
from libdsec.e2b.sandbox.commands.command_handle import (CommandExitException, CommandResult, PtyOutput, PtySize,
                                                         Stderr, Stdout)
from libdsec.e2b.sandbox.commands.main import ProcessInfo
from libdsec.e2b.sandbox.filesystem.filesystem import EntryInfo, FileType, WriteEntry, WriteInfo
from libdsec.e2b.sandbox.filesystem.watch_handle import FilesystemEvent, FilesystemEventType
from libdsec.e2b.sandbox.sandbox_api import SnapshotInfo
from libdsec.e2b.sandbox_async.filesystem.watch_handle import AsyncWatchHandle
from libdsec.e2b.sandbox_sync.filesystem.watch_handle import WatchHandle
from libdsec.e2b.sandbox.sandbox_api import SandboxInfo, SandboxQuery, SandboxState
from libdsec.e2b.sandbox_async.commands.command_handle import AsyncCommandHandle, OutputHandler
from libdsec.e2b.sandbox_async.main import AsyncSandbox, AsyncSandboxPaginator
from libdsec.e2b.sandbox_sync.commands.command_handle import CommandHandle
from libdsec.e2b.sandbox_sync.main import Sandbox, SandboxPaginator


def install() -> None:
    """Make `import e2b` (and `from e2b.sandbox.commands.command_handle import ...`, ...) resolve to this
    facade, for code that must run unchanged. Call it before that code imports e2b."""
    here = sys.modules[__name__]
    sys.modules["e2b"] = here
    for info in pkgutil.walk_packages(here.__path__, prefix=f"{__name__}."):
        module = importlib.import_module(info.name)
        sys.modules["e2b" + info.name[len(__name__):]] = module


__all__ = [
    "AsyncCommandHandle", "AsyncSandbox", "AsyncSandboxPaginator", "AuthenticationException", "CommandExitException",
    "AsyncWatchHandle", "CommandHandle", "CommandResult", "EntryInfo", "FileNotFoundException", "FileType",
    "FilesystemEvent", "FilesystemEventType", "InvalidArgumentException", "SnapshotInfo", "WatchHandle",
    "NotEnoughSpaceException", "NotFoundException", "OutputHandler", "ProcessInfo", "PtyOutput", "PtySize",
    "RateLimitException", "Sandbox", "SandboxException", "SandboxInfo", "SandboxNotFoundException",
    "SandboxPaginator", "SandboxQuery", "SandboxState", "Secret", "Stderr", "Stdout", "TemplateException",
    "TimeoutException", "WriteEntry", "WriteInfo", "install",
    # importable so code naming them runs; DSec raises none of these, and Template/AsyncTemplate refuse any use
    "AsyncTemplate", "BuildException", "FileUploadException", "GitAuthException", "GitUpstreamException", "Template",
]
