"""CPUPagePool: the seed's host page pool, served by the kvpool agent.

Each call is one call into libkvpool.so (the Go client): one round trip to
the agent for the page numbers, then batched copies on the client's own
CUDA streams. sync() orders the engine's current stream behind them."""

import array
import ctypes
import dataclasses
import os
import threading
from collections.abc import Mapping

from . import _lib as L
from . import errors
from .layout import regions_of

_ENC = "utf-8"


@dataclasses.dataclass
class OffloadedStream:
    """One (request, label) stream living on the host."""

    cpu_page_indices: list
    stored_len: int
    position: int
    released: int = 0


def _overrides(config):
    """The kvpool overrides config carries: config.kvpool or config["kvpool"]
    (a mapping or an object with attributes), else none."""
    if config is None:
        return {}
    o = config.get("kvpool") if isinstance(config, Mapping) else getattr(config, "kvpool", None)
    if o is None:
        return {}
    if isinstance(o, Mapping):
        return dict(o)
    return {k: getattr(o, k) for k in dir(o) if not k.startswith("_")}


_KNOWN = {"socket", "token", "backend", "device", "page_axis", "name", "timeout_s", "sim_copy_delay_us",
          "sim_devices", "order_stream", "spin_wait_us", "ranks"}


def _pages(indices):
    """gpu_page_indices as (pointer, count, keepalive): a list of ints, an
    integer torch tensor or numpy array."""
    if isinstance(indices, (list, tuple, range)):
        try:
            a = array.array("i", indices)
        except (OverflowError, TypeError) as e:
            raise errors.InvalidArgumentError("kvpool: gpu_page_indices: %s" % e) from None
        return a.buffer_info()[0], len(a), a
    mod = type(indices).__module__
    if mod.startswith("torch"):
        import torch
        if indices.dtype not in (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8):
            raise errors.InvalidArgumentError("kvpool: gpu_page_indices of dtype %s (want integers)" % indices.dtype)
        t = indices.reshape(-1)
        if t.dtype != torch.int32 or t.device.type != "cpu" or not t.is_contiguous():
            if t.numel() and (int(t.min()) < -(1 << 31) or int(t.max()) >= 1 << 31):
                raise errors.InvalidArgumentError("kvpool: gpu_page_indices: an index does not fit 32 bits")
            t = t.to(device="cpu", dtype=torch.int32).contiguous()
        return t.data_ptr(), t.numel(), t
    if mod.startswith("numpy"):
        import numpy as np
        if indices.dtype.kind not in "iu":
            raise errors.InvalidArgumentError("kvpool: gpu_page_indices of dtype %s (want integers)" % indices.dtype)
        flat = indices.reshape(-1)
        if flat.size and (int(flat.min()) < -(1 << 31) or int(flat.max()) >= 1 << 31):
            raise errors.InvalidArgumentError("kvpool: gpu_page_indices: an index does not fit 32 bits")
        a = np.ascontiguousarray(flat, dtype=np.int32)
        return a.ctypes.data, a.size, a
    try:
        return _pages(list(indices))
    except TypeError:
        raise errors.InvalidArgumentError(
            "kvpool: gpu_page_indices must be a list of ints or an integer tensor, not %s" % type(indices).__name__) from None


def _name(v, what):
    if not isinstance(v, str):
        raise TypeError("kvpool: %s must be a str, not %s" % (what, type(v).__name__))
    b = v.encode(_ENC)
    return b, len(b)


class CPUPagePool:
    """Host mirror of the paged KV cache, holding whatever is offloaded.

    config: the engine's config; only its `kvpool` entry (attribute or key)
    is read, for overrides: socket, token, backend ("auto", "cuda", "sim"),
    device, page_axis (default 1), name, timeout_s, order_stream,
    sim_copy_delay_us, sim_devices, spin_wait_us (how long a call polls for
    the agent's reply before its thread sleeps; default 50, negative: never),
    ranks (the tensor-parallel ranks on this node that share the pod's host
    KV, one per GPU; default 0: the agent counts the container's GPUs).
    The GPU is the kv_cache's own device (cuda:N, the engine's), never one
    chosen to suit the host memory.
    kv_cache: the device KV cache (see kvpool.layout).
    max_cpu_pages: host pages this pool holds.
    """

    def __init__(self, config, kv_cache, max_cpu_pages):
        o = _overrides(config)
        unknown = set(o) - _KNOWN
        if unknown:
            raise ValueError("kvpool: unknown config.kvpool keys %s (known: %s)" % (sorted(unknown), sorted(_KNOWN)))
        if isinstance(max_cpu_pages, bool) or not isinstance(max_cpu_pages, int) or max_cpu_pages <= 0:
            raise ValueError("kvpool: max_cpu_pages must be a positive int, got %r" % (max_cpu_pages,))
        self._page_axis = int(o.get("page_axis", 1))
        regions, device = regions_of(kv_cache, self._page_axis)
        self._kv_cache = kv_cache
        self._regions = regions
        self._h = None
        backend = o.get("backend")
        if device[0] == "cuda":
            backend = backend or "cuda"
            ordinal = device[1]
        else:
            backend = backend or "sim"
            ordinal = 0
        if backend not in ("auto", "cuda", "sim"):
            raise ValueError("kvpool: backend %r (want auto, cuda or sim)" % (backend,))
        if device[0] == "cpu" and backend != "sim":
            raise errors.LayoutError("kvpool: kv_cache is host memory: only the simulator (backend sim) can use it")
        if "device" in o:
            ordinal = int(o["device"])
        self._torch_device = device
        self._cuda = device[0] == "cuda"
        order = o.get("order_stream")
        if order is None:
            order = self._current_stream()
        self._order = int(order)
        self._lib = L.lib()
        L.users.add(self)
        regs = (L.Region * len(regions))(*[L.Region(*r) for r in regions])
        opts = L.Options()
        opts.struct_size = ctypes.sizeof(L.Options)
        opts.device = ordinal
        opts.socket = str(o.get("socket") or os.environ.get("KVPOOL_SOCKET", "")).encode()
        opts.token = str(o.get("token") or os.environ.get("KVPOOL_TOKEN", "")).encode()
        opts.backend = backend.encode()
        opts.name = str(o.get("name") or "kvpool-python pid %d" % os.getpid()).encode()
        opts.regions = regs
        opts.n_regions = len(regions)
        opts.sim_devices = int(o.get("sim_devices", 0))
        opts.max_pages = max_cpu_pages
        opts.order_stream = self._order
        opts.timeout_ms = int(float(o.get("timeout_s", 30)) * 1000)
        opts.sim_copy_delay_us = int(o.get("sim_copy_delay_us", 0))
        opts.spin_wait_us = int(o.get("spin_wait_us", 0))
        opts.ranks = int(o.get("ranks", 0))
        h = ctypes.c_uint64()
        self._check(self._lib.kvpool_open(ctypes.byref(opts), ctypes.byref(h)))
        self._h = h.value
        # The library writes results into buffers the caller owns: each
        # thread has its own, so that two threads calling at once do not
        # read each other's answers.
        self._tls = threading.local()

    def _bufs(self):
        """The calling thread's result buffers."""
        try:
            return self._tls.b
        except AttributeError:
            b = self._tls.b = _Buffers()
            return b

    # -- helpers -----------------------------------------------------------

    def _check(self, rc):
        if rc < 0:
            raise errors.from_status(rc, L.last_error(self._lib))
        return rc

    def _current_stream(self):
        if not self._cuda:
            return 0
        import torch
        return torch.cuda.current_stream(self._torch_device[1]).cuda_stream

    def _same_layout(self, gpu_kv_cache):
        if gpu_kv_cache is self._kv_cache:
            return
        regions, _ = regions_of(gpu_kv_cache, self._page_axis)
        if regions != self._regions:
            raise errors.LayoutError(
                "kvpool: gpu_kv_cache is not the KV cache this pool was built for (its regions %s differ from %s)"
                % (_short(regions), _short(self._regions)))

    def _handle(self):
        if self._h is None:
            raise errors.SessionClosedError("kvpool: the pool is closed")
        return self._h

    # -- the seed's API ----------------------------------------------------

    def offload_stream(self, rid, label, gpu_kv_cache, gpu_page_indices, stored_len, position, released=0):
        """Copy device pages to the host. False when the host pool is full,
        in which case nothing moved and the caller keeps its device pages."""
        h = self._handle()
        r, rn = _name(rid, "rid")
        lb, ln = _name(label, "label")
        self._same_layout(gpu_kv_cache)
        ptr, n, keep = _pages(gpu_page_indices)
        if n == 0:
            return False
        rc = self._lib.kvpool_offload(h, r, rn, lb, ln, ptr, n, stored_len, position, released)
        if rc < 0:
            self._check(rc)
        del keep
        return rc == 1

    def reload_stream(self, rid, label, gpu_kv_cache, gpu_page_indices):
        """Copy the host pages back onto gpu_page_indices and release them.
        Returns the stream metadata saved at offload."""
        h = self._handle()
        r, rn = _name(rid, "rid")
        lb, ln = _name(label, "label")
        self._same_layout(gpu_kv_cache)
        ptr, n, keep = _pages(gpu_page_indices)
        b = self._bufs()
        if n > len(b.host):
            b.host = (ctypes.c_int32 * max(n, 2 * len(b.host)))()
        m = b.meta
        rc = self._lib.kvpool_reload(h, r, rn, lb, ln, ptr, n, b.host, len(b.host), m)
        del keep
        if rc < 0:
            self._check(rc)
        return OffloadedStream(b.host[:m.num_pages], m.stored_len, m.position, m.released)

    def discard(self, rid, label):
        """Drop a stream that was copied here but never committed to. A
        stream that does not exist is not an error (the seed's engine
        discards every label it claimed after a failed offload)."""
        h = self._handle()
        r, rn = _name(rid, "rid")
        lb, ln = _name(label, "label")
        rc = self._lib.kvpool_discard(h, r, rn, lb, ln)
        if rc < 0 and rc != L.ERR_UNKNOWN_STREAM:
            self._check(rc)

    def remove_request(self, rid):
        h = self._handle()
        r, rn = _name(rid, "rid")
        self._check(self._lib.kvpool_remove_request(h, r, rn))

    def is_offloaded(self, rid):
        h = self._handle()
        r, rn = _name(rid, "rid")
        return self._check(self._lib.kvpool_is_offloaded(h, r, rn)) == 1

    def labels(self, rid):
        h = self._handle()
        r, rn = _name(rid, "rid")
        b = self._bufs()
        while True:
            rc = self._lib.kvpool_labels(h, r, rn, b.labels, len(b.labels), b.ends, len(b.ends), b.nl, b.nb)
            if rc != L.ERR_BUFFER_TOO_SMALL:
                break
            if b.nb.value > len(b.labels):
                b.labels = ctypes.create_string_buffer(b.nb.value)
            if b.nl.value > len(b.ends):
                b.ends = (ctypes.c_size_t * b.nl.value)()
        self._check(rc)
        raw = b.labels.raw
        out, start = [], 0
        for i in range(b.nl.value):
            end = b.ends[i]
            out.append(raw[start:end].decode(_ENC, "surrogateescape"))
            start = end
        return out

    def num_pages(self, rid, label):
        """Host pages the stream holds; 0 for a stream that does not exist."""
        h = self._handle()
        r, rn = _name(rid, "rid")
        lb, ln = _name(label, "label")
        out = self._bufs().out
        rc = self._lib.kvpool_num_pages(h, r, rn, lb, ln, out)
        if rc == L.ERR_UNKNOWN_STREAM:
            return 0
        self._check(rc)
        return out.value

    @property
    def num_free_pages(self):
        out = self._bufs().out
        self._check(self._lib.kvpool_num_free_pages(self._handle(), out))
        return out.value

    def sync(self):
        """Order the current stream behind the pending copies."""
        self._check(self._lib.kvpool_sync(self._handle(), self._current_stream()))

    # -- beyond the seed: lifetime and test hooks ----------------------------

    def close(self):
        """Wait for pending copies and end the session (its pages go back to
        the allocation). Also run when the pool is garbage collected."""
        if self._h is not None:
            h, self._h = self._h, None
            self._check(self._lib.kvpool_close(h))

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _synchronize(self):
        """Block until every copy so far has completed."""
        self._check(self._lib.kvpool_synchronize(self._handle()))

    def _stream_synchronize(self, stream=None):
        """Block until the work on stream (default: the current stream) is
        done: on the simulator, what a kernel reading the pages would wait
        for."""
        s = self._current_stream() if stream is None else stream
        self._check(self._lib.kvpool_stream_synchronize(self._handle(), s))

    def _info(self):
        i = L.Info()
        self._check(self._lib.kvpool_info_get(self._handle(), ctypes.byref(i)))
        return {"session": i.session, "capacity": i.capacity, "host_page_bytes": i.host_page_bytes,
                "device": i.device, "simulated": bool(i.simulated)}

    def _locality(self):
        """kvpool.locality(pool): the class keeps the seed's surface."""
        h = self._handle()
        loc = L.Locality()
        loc.struct_size = ctypes.sizeof(L.Locality)
        self._check(self._lib.kvpool_locality_get(h, ctypes.byref(loc)))
        n = ctypes.c_int64()
        buf = (ctypes.c_int32 * max(loc.chunks, 1))()
        self._check(self._lib.kvpool_chunk_numa(h, buf, len(buf), ctypes.byref(n)))
        return {"gpu_numa": loc.gpu_numa, "ranks": loc.ranks, "local": loc.local, "remote": loc.remote,
                "unknown": loc.unknown, "chunk_numa": list(buf[:n.value])}

    def _disconnect(self):
        self._check(self._lib.kvpool_disconnect(self._handle()))


def locality(pool):
    """Where pool's host memory lies relative to its GPU, as the agent said
    when the session opened: the GPU's NUMA node (gpu_numa), the ranks the
    pod's host KV is shared among, how many chunks are on the GPU's node
    (local), on another (remote: their copies cross the socket interconnect)
    or unknown, and each chunk's node (chunk_numa, -1 unknown). A function,
    not a method, so that CPUPagePool keeps exactly the seed's surface."""
    return pool._locality()


class _Buffers:
    """One thread's buffers for the library's answers."""

    __slots__ = ("meta", "out", "host", "labels", "ends", "nl", "nb")

    def __init__(self):
        self.meta = L.StreamMeta()
        self.out = ctypes.c_int64()
        self.host = (ctypes.c_int32 * 64)()
        self.labels = ctypes.create_string_buffer(4096)
        self.ends = (ctypes.c_size_t * 64)()
        self.nl, self.nb = ctypes.c_size_t(), ctypes.c_size_t()


def _short(regions):
    if len(regions) <= 2:
        return list(regions)
    return "[%s, ... %d regions]" % (regions[0], len(regions))
