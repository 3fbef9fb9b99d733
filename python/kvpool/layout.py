"""Device KV cache layout: the regions (base, stride, bytes per page, pages)
that the C ABI takes, derived from torch tensors or numpy arrays.

A kv_cache is a tensor whose page axis is `page_axis` (default 1: the seed
engine keeps [layers or K/V, pages, ...]), an object with such a `.tensor`,
or a list (tuple) of such tensors, one per layer. Every index of the axes
before the page axis is a region: for [L, P, ...] one region per layer, for
[2, L, P, ...] (page_axis 2) one per K/V and layer. The axes after the page
axis must be contiguous, so that one page of a region is one range of
bytes."""

import itertools

from .errors import LayoutError


class Tensor:
    """What the layout needs of one tensor."""

    __slots__ = ("ptr", "shape", "strides", "itemsize", "device", "kind")

    def __init__(self, ptr, shape, strides, itemsize, device, kind):
        self.ptr, self.shape, self.strides, self.itemsize = ptr, shape, strides, itemsize
        self.device, self.kind = device, kind  # device: ("cuda", index) or ("cpu", None)


def describe(t):
    """Returns a Tensor for a torch tensor or a numpy array."""
    mod = type(t).__module__
    if mod.startswith("torch"):
        dev = t.device
        device = ("cuda", dev.index if dev.index is not None else 0) if dev.type == "cuda" else (dev.type, None)
        isz = t.element_size()
        return Tensor(t.data_ptr(), tuple(t.shape), tuple(s * isz for s in t.stride()), isz, device, "torch")
    if mod.startswith("numpy"):
        ai = t.__array_interface__
        return Tensor(ai["data"][0], tuple(t.shape), tuple(t.strides), t.itemsize, ("cpu", None), "numpy")
    raise LayoutError("kvpool: kv_cache: %s is neither a torch tensor nor a numpy array" % type(t).__name__)


def tensors_of(kv_cache):
    """The tensors of a kv_cache argument, in region order."""
    if isinstance(kv_cache, (list, tuple)):
        if not kv_cache:
            raise LayoutError("kvpool: kv_cache is an empty list")
        return list(kv_cache)
    inner = getattr(kv_cache, "tensor", None)
    if inner is not None and not type(kv_cache).__module__.startswith(("torch", "numpy")):
        return tensors_of(inner)
    return [kv_cache]


def regions_of(kv_cache, page_axis=1):
    """Returns (regions, device) for kv_cache: regions a tuple of
    (base, stride, page_bytes, pages) in bytes, device ("cuda", index) or
    ("cpu", None). Raises LayoutError for what regions cannot express."""
    regions = []
    device = None
    pages = None
    for n, obj in enumerate(tensors_of(kv_cache)):
        t = describe(obj)
        where = "kv_cache" if n == 0 and not isinstance(kv_cache, (list, tuple)) else "kv_cache[%d]" % n
        if device is None:
            device = t.device
        elif t.device != device:
            raise LayoutError("kvpool: %s is on %s, the first tensor on %s" % (where, t.device, device))
        if device[0] not in ("cuda", "cpu"):
            raise LayoutError("kvpool: %s is on device type %r (want cuda, or cpu for the simulator)" % (where, device[0]))
        nd = len(t.shape)
        ax = page_axis + nd if page_axis < 0 else page_axis
        if not 0 <= ax < nd:
            raise LayoutError("kvpool: %s has %d dimensions, no page axis %d" % (where, nd, page_axis))
        p = t.shape[ax]
        if p <= 0:
            raise LayoutError("kvpool: %s has no pages (shape %s, page axis %d)" % (where, t.shape, ax))
        if pages is None:
            pages = p
        elif p != pages:
            raise LayoutError("kvpool: %s has %d pages, the first tensor %d" % (where, p, pages))
        # The axes after the page axis: one contiguous range per page.
        page_bytes = t.itemsize
        for d in range(nd - 1, ax, -1):
            if t.shape[d] == 0:
                raise LayoutError("kvpool: %s is empty (shape %s)" % (where, t.shape))
            if t.shape[d] != 1 and t.strides[d] != page_bytes:
                raise LayoutError(
                    "kvpool: %s: the axes after the page axis are not contiguous (shape %s, byte strides %s): "
                    "one page must be one range of bytes; make the tensor contiguous or choose another page axis"
                    % (where, t.shape, t.strides))
            page_bytes *= t.shape[d]
        stride = t.strides[ax]
        if p > 1 and stride < page_bytes:
            raise LayoutError(
                "kvpool: %s: pages are %d bytes apart but %d bytes long (shape %s, byte strides %s): "
                "they interleave, which regions cannot express" % (where, stride, page_bytes, t.shape, t.strides))
        if p == 1:
            stride = max(stride, page_bytes)
        lead = t.shape[:ax]
        for d in range(ax):
            if t.strides[d] < 0:
                raise LayoutError("kvpool: %s has a negative stride on axis %d" % (where, d))
            if lead[d] > 1 and t.strides[d] == 0:
                raise LayoutError("kvpool: %s is broadcast along axis %d (stride 0)" % (where, d))
        if stride < 0:
            raise LayoutError("kvpool: %s has a negative stride on the page axis" % where)
        for idx in itertools.product(*(range(s) for s in lead)):
            off = sum(i * s for i, s in zip(idx, t.strides))
            regions.append((t.ptr + off, stride, page_bytes, p))
    if not regions:
        raise LayoutError("kvpool: kv_cache has no regions")
    for i, r in enumerate(regions):
        if r[0] == 0:
            raise LayoutError("kvpool: region %d has address 0" % i)
    return tuple(regions), device
