"""ctypes binding of libkvpool.so (cmd/libkvpool, header kvpool.h).

The library is loaded once per process, on first use, from $KVPOOL_LIBRARY
or from libkvpool.so beside this file. It holds a Go runtime: one per
process, and a process that forks after loading it must not use it in the
child (see docs/c-abi.md)."""

import ctypes
import os
import threading
import weakref

ABI_VERSION = 1

OK = 0
ERR_INVALID = -1
ERR_BAD_HANDLE = -2
ERR_UNKNOWN_STREAM = -3
ERR_DUPLICATE_STREAM = -4
ERR_PAGE_COUNT = -5
ERR_OUT_OF_RANGE = -6
ERR_DUPLICATE_INDEX = -7
ERR_BAD_NAME = -8
ERR_BAD_SIZE = -9
ERR_CLOSED = -10
ERR_DISCONNECTED = -11
ERR_PROTOCOL = -12
ERR_CUDA = -13
ERR_UNAUTHORIZED = -14
ERR_BUSY = -15
ERR_NO_CAPACITY = -16
ERR_BUFFER_TOO_SMALL = -17
ERR_OTHER = -99


class Region(ctypes.Structure):
    _fields_ = [
        ("base", ctypes.c_uint64),
        ("stride", ctypes.c_uint64),
        ("page_bytes", ctypes.c_uint64),
        ("pages", ctypes.c_int64),
    ]


class Options(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("device", ctypes.c_int32),
        ("socket", ctypes.c_char_p),
        ("token", ctypes.c_char_p),
        ("backend", ctypes.c_char_p),
        ("name", ctypes.c_char_p),
        ("regions", ctypes.POINTER(Region)),
        ("n_regions", ctypes.c_int32),
        ("sim_devices", ctypes.c_int32),
        ("max_pages", ctypes.c_int64),
        ("order_stream", ctypes.c_uint64),
        ("timeout_ms", ctypes.c_int64),
        ("sim_copy_delay_us", ctypes.c_int64),
        ("spin_wait_us", ctypes.c_int64),
        ("ranks", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
    ]


class StreamMeta(ctypes.Structure):
    _fields_ = [
        ("stored_len", ctypes.c_int64),
        ("position", ctypes.c_int64),
        ("released", ctypes.c_int64),
        ("num_pages", ctypes.c_int64),
    ]


class Locality(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("gpu_numa", ctypes.c_int32),
        ("ranks", ctypes.c_int32),
        ("chunks", ctypes.c_int32),
        ("local", ctypes.c_int32),
        ("remote", ctypes.c_int32),
        ("unknown", ctypes.c_int32),
    ]


class Info(ctypes.Structure):
    _fields_ = [
        ("session", ctypes.c_uint64),
        ("capacity", ctypes.c_int64),
        ("host_page_bytes", ctypes.c_uint64),
        ("device", ctypes.c_int32),
        ("simulated", ctypes.c_int32),
    ]


_lock = threading.Lock()
_lib = None
_pid = None

H = ctypes.c_uint64
S = ctypes.c_char_p
N = ctypes.c_size_t
I64 = ctypes.c_int64
P = ctypes.c_void_p

_SIGNATURES = {
    "kvpool_abi_version": ([], ctypes.c_int),
    "kvpool_last_error": ([ctypes.c_char_p, N], N),
    "kvpool_open": ([ctypes.POINTER(Options), ctypes.POINTER(H)], ctypes.c_int),
    "kvpool_close": ([H], ctypes.c_int),
    "kvpool_offload": ([H, S, N, S, N, P, I64, I64, I64, I64], ctypes.c_int),
    "kvpool_reload": ([H, S, N, S, N, P, I64, P, I64, ctypes.POINTER(StreamMeta)], ctypes.c_int),
    "kvpool_discard": ([H, S, N, S, N], ctypes.c_int),
    "kvpool_remove_request": ([H, S, N], ctypes.c_int),
    "kvpool_is_offloaded": ([H, S, N], ctypes.c_int),
    "kvpool_labels": ([H, S, N, P, N, P, N, ctypes.POINTER(N), ctypes.POINTER(N)], ctypes.c_int),
    "kvpool_num_pages": ([H, S, N, S, N, ctypes.POINTER(I64)], ctypes.c_int),
    "kvpool_num_free_pages": ([H, ctypes.POINTER(I64)], ctypes.c_int),
    "kvpool_sync": ([H, ctypes.c_uint64], ctypes.c_int),
    "kvpool_synchronize": ([H], ctypes.c_int),
    "kvpool_stream_synchronize": ([H, ctypes.c_uint64], ctypes.c_int),
    "kvpool_info_get": ([H, ctypes.POINTER(Info)], ctypes.c_int),
    "kvpool_locality_get": ([H, ctypes.POINTER(Locality)], ctypes.c_int),
    "kvpool_chunk_numa": ([H, P, I64, ctypes.POINTER(I64)], ctypes.c_int),
    "kvpool_disconnect": ([H], ctypes.c_int),
}


def library_path():
    p = os.environ.get("KVPOOL_LIBRARY")
    if p:
        return p
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "libkvpool.so")


# Objects holding the library (pools), whose .lib is replaced in a forked
# child.
users = weakref.WeakSet()


def _forked():
    global _lib
    # The Go runtime's threads did not survive the fork: a call would hang
    # or crash. Make the child fail clearly instead.
    if _lib is not None:
        _lib = _ForkedLibrary()
        for u in list(users):
            u._lib = _lib


class _ForkedLibrary:
    def __getattr__(self, name):
        raise RuntimeError(
            "kvpool: libkvpool.so was loaded before this process forked; the Go runtime "
            "does not survive fork(). Create CPUPagePool in the worker process (spawn), "
            "not before forking it")


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def lib():
    """Returns the loaded library, loading it on first use."""
    global _lib
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        path = library_path()
        if not os.path.exists(path) and os.sep in path:
            raise OSError(
                "kvpool: the client library %s does not exist (build it with "
                "`go build -buildmode=c-shared -o python/kvpool/libkvpool.so ./cmd/libkvpool`, "
                "install the wheel, or set KVPOOL_LIBRARY)" % path)
        l = ctypes.CDLL(path)
        for name, (args, res) in _SIGNATURES.items():
            f = getattr(l, name)
            f.argtypes = args
            f.restype = res
        v = l.kvpool_abi_version()
        if v != ABI_VERSION:
            raise OSError("kvpool: %s implements C ABI %d, this package needs %d" % (path, v, ABI_VERSION))
        _lib = l
        return l


def last_error(l):
    buf = ctypes.create_string_buffer(1024)
    n = l.kvpool_last_error(buf, len(buf))
    if n >= len(buf):
        buf = ctypes.create_string_buffer(n + 1)
        l.kvpool_last_error(buf, len(buf))
    return buf.value.decode("utf-8", "replace")
