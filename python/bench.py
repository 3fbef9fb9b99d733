"""Times offload_stream + reload_stream of a 64-page stream through the
Python client: `python3 python/bench.py --iters N` with KVPOOL_SOCKET and
KVPOOL_TOKEN set (or --socket/--token). Prints one JSON line. Run by
python/bench_test.go next to the same loop on the Go client, which gives
the ratio (docs/benchmarks.md)."""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvpool  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--session-pages", type=int, default=128)
    ap.add_argument("--device-pages", type=int, default=256)
    ap.add_argument("--page-bytes", type=int, default=256, help="bytes per page in each of the K and V regions")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--socket", default=os.environ.get("KVPOOL_SOCKET", ""))
    ap.add_argument("--token", default=os.environ.get("KVPOOL_TOKEN", ""))
    a = ap.parse_args()
    try:
        import torch
        kv = torch.zeros((2, a.device_pages, a.page_bytes), dtype=torch.uint8)
        kind = "torch %s" % torch.__version__
    except ImportError:
        import numpy as np
        kv = np.zeros((2, a.device_pages, a.page_bytes), dtype=np.uint8)
        kind = "numpy"
    cfg = {"kvpool": {"socket": a.socket, "token": a.token, "device": a.gpu}}
    pool = kvpool.CPUPagePool(cfg, kv, a.session_pages)
    pages = list(range(0, 2 * a.pages, 2))  # scattered: no two copies merge
    back = list(range(1, 2 * a.pages, 2))
    for _ in range(min(200, a.iters)):
        assert pool.offload_stream("bench", "kv", kv, pages, 1, 2)
        pool.reload_stream("bench", "kv", kv, back)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(a.iters):
        pool.offload_stream("bench", "kv", kv, pages, 1, 2)
        pool.reload_stream("bench", "kv", kv, back)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    pool.sync()
    # The boundary alone: a ctypes call into the library that does no work.
    f = pool._lib.kvpool_abi_version
    n = 100000
    t1 = time.perf_counter()
    for _ in range(n):
        f()
    noop = (time.perf_counter() - t1) / n * 1e9
    # The Python layer's own work for one call, without the library:
    # argument conversion and the layout identity check.
    from kvpool.pool import _name, _pages
    t1 = time.perf_counter()
    for _ in range(n // 10):
        _name("bench", "rid")
        _name("kv", "label")
        pool._same_layout(kv)
        _pages(pages)
    prep = (time.perf_counter() - t1) / (n // 10) * 1e9
    pool.close()
    print(json.dumps({"iters": a.iters, "ns_per_pair": dt / a.iters * 1e9, "cpu_ns_per_pair": dc / a.iters * 1e9, "tensors": kind, "noop_call_ns": noop, "prep_ns": prep}))


if __name__ == "__main__":
    main()
