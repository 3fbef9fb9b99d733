"""Exceptions of the kvpool client. Each carries the agent's (or the
library's) message and the C ABI status; each also derives from the built-in
exception an engine would expect (KeyError for an unknown stream, as the
seed's reference raises)."""

from . import _lib as L


class KVPoolError(Exception):
    """Base of every kvpool error. status is the kvpool.h status code."""

    status = L.ERR_OTHER

    def __init__(self, message, status=None):
        super().__init__(message)
        if status is not None:
            self.status = status

    def __str__(self):
        # KeyError would quote the message; keep it readable.
        return str(self.args[0]) if self.args else ""


class InvalidArgumentError(KVPoolError, ValueError):
    status = L.ERR_INVALID


class UnknownStreamError(KVPoolError, KeyError):
    status = L.ERR_UNKNOWN_STREAM


class DuplicateStreamError(KVPoolError, ValueError):
    status = L.ERR_DUPLICATE_STREAM


class PageCountError(KVPoolError, ValueError):
    status = L.ERR_PAGE_COUNT


class PageIndexError(KVPoolError, IndexError):
    status = L.ERR_OUT_OF_RANGE


class DuplicateIndexError(KVPoolError, ValueError):
    status = L.ERR_DUPLICATE_INDEX


class BadNameError(KVPoolError, ValueError):
    status = L.ERR_BAD_NAME


class BadSizeError(KVPoolError, ValueError):
    status = L.ERR_BAD_SIZE


class SessionClosedError(KVPoolError, RuntimeError):
    status = L.ERR_CLOSED


class DisconnectedError(KVPoolError, ConnectionError):
    status = L.ERR_DISCONNECTED


class ProtocolError(KVPoolError, RuntimeError):
    status = L.ERR_PROTOCOL


class CUDAError(KVPoolError, RuntimeError):
    status = L.ERR_CUDA


class UnauthorizedError(KVPoolError, PermissionError):
    status = L.ERR_UNAUTHORIZED


class BusyError(KVPoolError, RuntimeError):
    status = L.ERR_BUSY


class NoCapacityError(KVPoolError, RuntimeError):
    status = L.ERR_NO_CAPACITY


class LayoutError(KVPoolError, ValueError):
    """A kv_cache whose layout cannot be expressed as regions, or a
    gpu_kv_cache that is not the layout given at construction."""

    status = L.ERR_INVALID


_BY_STATUS = {c.status: c for c in (
    InvalidArgumentError, UnknownStreamError, DuplicateStreamError, PageCountError, PageIndexError,
    DuplicateIndexError, BadNameError, BadSizeError, SessionClosedError, DisconnectedError,
    ProtocolError, CUDAError, UnauthorizedError, BusyError, NoCapacityError)}


def from_status(status, message):
    cls = _BY_STATUS.get(status, KVPoolError)
    return cls(message, status)
