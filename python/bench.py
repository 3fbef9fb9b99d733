"""Times offload_stream + reload_stream of a 64-page stream through the
Python client: `python3 python/bench.py --iters N` with KVPOOL_SOCKET and
KVPOOL_TOKEN set (or --socket/--token). Prints one JSON line.

With --rounds it serves python/bench_test.go instead: after the warm-up it
prints {"ready": true}, then for every line N read from stdin runs N pairs
and prints {"ns": wall, "cpu_ns": cpu} for them; at the end of stdin it
prints the one-line figures of the boundary alone (noop_call_ns, prep_ns).
The benchmark alternates such rounds with the Go client's, so that both
are measured under the same load (docs/benchmarks.md)."""

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
    ap.add_argument("--rounds", action="store_true", help="serve rounds named on stdin (python/bench_test.go)")
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--session-pages", type=int, default=128)
    ap.add_argument("--device-pages", type=int, default=256)
    ap.add_argument("--page-bytes", type=int, default=256, help="bytes per page in each of the K and V regions")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--spin-us", type=int, default=0, help="spin_wait_us (0: the default, negative: none)")
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
    cfg = {"kvpool": {"socket": a.socket, "token": a.token, "device": a.gpu, "sim_devices": max(2, a.gpu + 1),
                      "spin_wait_us": a.spin_us}}
    pool = kvpool.CPUPagePool(cfg, kv, a.session_pages)
    pages = list(range(0, 2 * a.pages, 2))  # scattered: no two copies merge
    back = list(range(1, 2 * a.pages, 2))

    def pairs(n):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            pool.offload_stream("bench", "kv", kv, pages, 1, 2)
            pool.reload_stream("bench", "kv", kv, back)
        return (time.perf_counter() - t0) * 1e9, (time.process_time() - c0) * 1e9

    for _ in range(200):
        assert pool.offload_stream("bench", "kv", kv, pages, 1, 2)
        pool.reload_stream("bench", "kv", kv, back)
    out = {"tensors": kind, "library": os.environ.get("KVPOOL_LIBRARY", "")}
    if a.rounds:
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            n = int(line)
            ns, cpu = pairs(n)
            print(json.dumps({"ns": ns, "cpu_ns": cpu}), flush=True)
    else:
        ns, cpu = pairs(a.iters)
        out.update({"iters": a.iters, "ns_per_pair": ns / a.iters, "cpu_ns_per_pair": cpu / a.iters})
    pool.sync()
    # The boundary alone: a ctypes call into the library that does no work.
    f = pool._lib.kvpool_abi_version
    n = 100000
    t1 = time.perf_counter()
    for _ in range(n):
        f()
    out["noop_call_ns"] = (time.perf_counter() - t1) / n * 1e9
    # The Python layer's own work for one call, without the library:
    # argument conversion and the layout identity check.
    from kvpool.pool import _name, _pages
    t1 = time.perf_counter()
    for _ in range(n // 10):
        _name("bench", "rid")
        _name("kv", "label")
        pool._same_layout(kv)
        _pages(pages)
    out["prep_ns"] = (time.perf_counter() - t1) / (n // 10) * 1e9
    pool.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
