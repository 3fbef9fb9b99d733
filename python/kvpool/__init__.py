"""kvpool: the seed's CPUPagePool served by the kvpool node agent.

    from kvpool import CPUPagePool, OffloadedStream
    pool = CPUPagePool(config, kv_cache, max_cpu_pages)

A thin layer over libkvpool.so, the C ABI of the Go client; see
python/README.md and docs/python.md."""

from .errors import (BadNameError, BadSizeError, BusyError, CUDAError, DisconnectedError, DuplicateIndexError,
                     DuplicateStreamError, InvalidArgumentError, KVPoolError, LayoutError, NoCapacityError,
                     PageCountError, PageIndexError, ProtocolError, SessionClosedError, UnauthorizedError,
                     UnknownStreamError)
from .pool import CPUPagePool, OffloadedStream, locality

__all__ = [
    "CPUPagePool", "OffloadedStream", "locality", "KVPoolError", "InvalidArgumentError", "UnknownStreamError",
    "DuplicateStreamError", "PageCountError", "PageIndexError", "DuplicateIndexError", "BadNameError",
    "BadSizeError", "SessionClosedError", "DisconnectedError", "ProtocolError", "CUDAError",
    "UnauthorizedError", "BusyError", "NoCapacityError", "LayoutError",
]

__version__ = "0.1.0"
