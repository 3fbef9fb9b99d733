"""Golden vectors shared with the Go suite (python/golden_test.go): the
regions each layout must yield and one scenario's outcomes and final device
bytes (python/testdata/golden.json, written by gen_golden.py)."""

import hashlib
import json
import os

import pytest

from helpers import config, np

import kvpool
from kvpool.layout import regions_of

GOLDEN = json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testdata", "golden.json")))

ERRORS = {
    "duplicate_stream": kvpool.DuplicateStreamError,
    "unknown_stream": kvpool.UnknownStreamError,
    "out_of_range": kvpool.PageIndexError,
    "page_count": kvpool.PageCountError,
}


def make_view(lay, buf):
    """The layout's tensor over buf (uint8, buffer_bytes long)."""
    dt = np.dtype("u%d" % lay["itemsize"])
    n = len(buf) // lay["itemsize"] * lay["itemsize"]
    typed = buf[:n].view(dt) if n else buf.view(dt)
    return np.lib.stride_tricks.as_strided(typed, shape=lay["shape"], strides=lay["byte_strides"], writeable=True)


@pytest.mark.parametrize("lay", GOLDEN["layouts"], ids=lambda l: l["name"])
def test_golden_regions(lay):
    buf = np.zeros(lay["buffer_bytes"] + lay["itemsize"], dtype=np.uint8)
    t = make_view(lay, buf)
    got, dev = regions_of(t, lay["page_axis"])
    base = buf.ctypes.data
    want = tuple((base + r["offset"], r["stride"], r["page_bytes"], r["pages"]) for r in lay["regions"])
    assert got == want
    assert dev == ("cpu", None)


def test_golden_scenario(agent):
    sc = GOLDEN["scenario"]
    lay = next(l for l in GOLDEN["layouts"] if l["name"] == sc["layout"])
    n = lay["buffer_bytes"]
    i = np.arange(n, dtype=np.uint64)
    buf = ((i * 7 + i // 251) & 0xFF).astype(np.uint8)
    kv = make_view(lay, buf)
    pool = kvpool.CPUPagePool(config(page_axis=lay["page_axis"]), kv, sc["max_pages"])
    try:
        for k, op in enumerate(sc["ops"]):
            name = op["op"]
            if name == "offload":
                call = lambda: pool.offload_stream(op["rid"], op["label"], kv, op["pages"], op["stored_len"],
                                                   op["position"], op["released"])
            elif name == "reload":
                call = lambda: pool.reload_stream(op["rid"], op["label"], kv, op["pages"])
            elif name == "discard":
                call = lambda: pool.discard(op["rid"], op["label"])
            elif name == "remove_request":
                call = lambda: pool.remove_request(op["rid"])
            elif name == "num_pages":
                call = lambda: pool.num_pages(op["rid"], op["label"])
            elif name == "labels":
                call = lambda: pool.labels(op["rid"])
            elif name == "is_offloaded":
                call = lambda: pool.is_offloaded(op["rid"])
            elif name == "num_free_pages":
                call = lambda: pool.num_free_pages
            elif name == "synchronize":
                call = lambda: (pool.sync(), pool._stream_synchronize(), pool._synchronize())
            elif name == "poison":
                def call():
                    for r in lay["regions"]:
                        for p in op["pages"]:
                            s = r["offset"] + p * r["stride"]
                            buf[s:s + r["page_bytes"]] = op["byte"]
            else:
                raise AssertionError("unknown op %s" % name)
            if "error" in op:
                with pytest.raises(ERRORS[op["error"]]):
                    call()
                continue
            got = call()
            if "want" in op:
                want = op["want"]
                if name == "reload":
                    got = {"stored_len": got.stored_len, "position": got.position, "released": got.released,
                           "num_pages": len(got.cpu_page_indices)}
                assert got == want, "op %d %s" % (k, op)
        pool.sync()
        pool._stream_synchronize()
        pool._synchronize()
        assert hashlib.sha256(buf.tobytes()).hexdigest() == sc["sha256"]
    finally:
        pool.close()
