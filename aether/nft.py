"""nftables through libnftables (Debian's libnftables1), by ctypes: no `nft` subprocess, one netlink
transaction per call. Commands are nft's own syntax; each call is atomic (all of it or none)."""
from __future__ import annotations

import ctypes
import ctypes.util
import threading


class NftError(Exception):
    """libnftables refused a command (its message says why) or is not installed."""


_lib: ctypes.CDLL | None = None
_load_lock = threading.Lock()


def _library() -> ctypes.CDLL:
    global _lib
    with _load_lock:
        if _lib is None:
            name = ctypes.util.find_library("nftables") or "libnftables.so.1"
            try:
                lib = ctypes.CDLL(name)
            except OSError as exc:
                raise NftError(f"libnftables is not installed ({exc}): apt-get install nftables") from None
            lib.nft_ctx_new.restype = ctypes.c_void_p
            lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
            lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
            for name in ("nft_ctx_buffer_output", "nft_ctx_buffer_error"):
                getattr(lib, name).argtypes = [ctypes.c_void_p]
                getattr(lib, name).restype = ctypes.c_int
            for name in ("nft_ctx_get_output_buffer", "nft_ctx_get_error_buffer"):
                getattr(lib, name).argtypes = [ctypes.c_void_p]
                getattr(lib, name).restype = ctypes.c_char_p
            lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
            lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
            _lib = lib
        return _lib


class Nft:
    """One libnftables context (not thread-safe: one per thread, or a lock around it)."""

    def __init__(self) -> None:
        self._lib = _library()
        self._ctx = self._lib.nft_ctx_new(0)
        if not self._ctx:
            raise NftError("nft_ctx_new failed")
        self._lib.nft_ctx_buffer_output(self._ctx)
        self._lib.nft_ctx_buffer_error(self._ctx)
        self._lock = threading.Lock()

    def run(self, commands: str) -> str:
        """Run nft commands (one transaction); their output; NftError with nft's message on failure."""
        with self._lock:
            rc = self._lib.nft_run_cmd_from_buffer(self._ctx, commands.encode())
            out = (self._lib.nft_ctx_get_output_buffer(self._ctx) or b"").decode(errors="replace")
            err = (self._lib.nft_ctx_get_error_buffer(self._ctx) or b"").decode(errors="replace")
        if rc != 0:
            raise NftError(err.strip() or f"nft failed ({rc})")
        return out

    def close(self) -> None:
        if self._ctx:
            self._lib.nft_ctx_free(self._ctx)
            self._ctx = None

    def __enter__(self) -> "Nft":
        return self

    def __exit__(self, *_exc) -> None:
        self.close()
