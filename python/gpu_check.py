#!/usr/bin/env python3
"""The Python part of hack/gpu/check.sh: byte checks of the kvpool Python
client on torch CUDA tensors, then, side by side in one run, the Python
client, the Go client and a torch baseline written from the seed's doc
moving the same 64 scattered pages of a realistic layout (32 layers x K/V,
16-token pages, 8 KV heads of 128, bf16: 64 regions of 32 KiB per page).

    python3 python/gpu_check.py --go-bin hack/gpu/_bin/python.test [--out DIR]
    python3 python/gpu_check.py --device cpu ...   # dry run on the simulator

Needs KVPOOL_SOCKET and KVPOOL_TOKEN of a running agent (check.sh starts
one). Prints GPU-PY-SKIP: <reason> and exits 0 where torch or CUDA is
missing. Writes python-table.md to --out."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def skip(reason):
    print("GPU-PY-SKIP: %s" % reason)
    sys.exit(0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--go-bin", default="")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--device-pages", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        skip("no torch (%s)" % e)
    if a.device == "cuda" and not torch.cuda.is_available():
        skip("torch %s sees no CUDA device" % torch.__version__)
    import kvpool

    dev = torch.device("cuda:0") if a.device == "cuda" else torch.device("cpu")
    cuda = a.device == "cuda"
    failures = []

    def settle(pool):
        pool.sync()
        if cuda:
            torch.cuda.current_stream(dev).synchronize()
        else:
            pool._stream_synchronize()

    def engine_wait(pool):
        # On CUDA the engine's next kernels are ordered on its stream by
        # sync(); on the simulator, CPU tensors are written at once, so wait
        # for the stream as those kernels would.
        if not cuda:
            pool._stream_synchronize()

    # 1. Byte checks: random bytes, poison, reload elsewhere, compare.
    def checks():
        L = 4
        layouts = [
            ("one tensor [2L, P, 16, 1024] bf16", lambda P: torch.empty((2 * L, P, 16, 1024), dtype=torch.bfloat16, device=dev), 1),
            ("K/V split [2, L, P, 16, 128] fp16", lambda P: torch.empty((2, L, P, 16, 128), dtype=torch.float16, device=dev), 2),
            ("list of L x [2, P, 16, 128] fp32", lambda P: [torch.empty((2, P, 16, 128), dtype=torch.float32, device=dev) for _ in range(L)], 1),
            ("page-major [P, 2L, 16, 128] bf16", lambda P: torch.empty((P, 2 * L, 16, 128), dtype=torch.bfloat16, device=dev), 0),
        ]
        for name, mk, axis in layouts:
            kv = mk(128)
            ts = kv if isinstance(kv, list) else [kv]
            for t in ts:
                t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, device=dev))
            src = [3, 77, 5, 6, 7, 100, 64, 1]
            dst = [9, 10, 11, 127, 0, 50, 51, 52]
            saved = [t.view(torch.uint8).movedim(axis, 0)[src].clone() for t in ts]
            pool = kvpool.CPUPagePool({"kvpool": {"page_axis": axis}}, kv, 32)
            ok = pool.offload_stream("chk", "a", kv, src, 1, 2, 3)
            pool.sync()
            engine_wait(pool)
            # The engine reuses the pages at once, on its stream: only sync()
            # keeps this poison out of the host copy.
            for t in ts:
                t.view(torch.uint8).movedim(axis, 0)[src] = 0xA5
                t.view(torch.uint8).movedim(axis, 0)[dst] = 0x5A
            st = pool.reload_stream("chk", "a", kv, dst)
            pool.sync()
            engine_wait(pool)
            got = [t.view(torch.uint8).movedim(axis, 0)[dst].clone() for t in ts]  # on the current stream, after sync
            settle(pool)
            same = ok and st.stored_len == 1 and st.released == 3 and all(torch.equal(g, s) for g, s in zip(got, saved))
            print("gpu py check: %-36s %s" % (name, "ok" if same else "MISMATCH"))
            if not same:
                failures.append(name)
            pool.close()

    checks()

    # 2. Side by side on the realistic layout.
    regions = 2 * a.layers
    shape = (regions, a.device_pages, a.tokens, a.kv_heads * a.head_dim)
    gpu = torch.zeros(shape, dtype=torch.bfloat16, device=dev)
    page_bytes = a.tokens * a.kv_heads * a.head_dim * 2
    batch_bytes = a.pages * regions * page_bytes
    src = list(range(0, 2 * a.pages, 2))
    dst = list(range(1, 2 * a.pages, 2))
    rows = []

    # Each direction's time, and the part of it spent enqueueing (the call
    # returned, the copies not yet waited for): medians of a.reps.
    enqueued = {}

    def timed(offload, reload, wait, name):
        off, rel, eoff, erel = [], [], [], []
        for r in range(a.reps + 1):
            t0 = time.perf_counter()
            offload()
            te = time.perf_counter()
            wait()
            t1 = time.perf_counter()
            reload()
            tr = time.perf_counter()
            wait()
            t2 = time.perf_counter()
            if r:
                off.append(t1 - t0)
                rel.append(t2 - t1)
                eoff.append(te - t0)
                erel.append(tr - t1)
        enqueued[name] = (statistics.median(eoff), statistics.median(erel))
        return statistics.median(off), statistics.median(rel)

    pool = kvpool.CPUPagePool(None, gpu, a.pages)
    py = timed(lambda: pool.offload_stream("b", "kv", gpu, src, 1, 1), lambda: pool.reload_stream("b", "kv", gpu, dst),
               pool._synchronize, "kvpool Python")
    pool.close()
    rows.append(("kvpool Python", py))

    def go_client(label, env):
        spec = {"backend": "cuda" if cuda else "sim", "device": 0, "regions": regions, "device_pages": a.device_pages,
                "page_bytes": page_bytes, "pages": a.pages, "reps": a.reps}
        r = subprocess.run([a.go_bin, "-test.run", "^TestGoClientCopyBench$", "-test.count", "1"],
                           env=dict(os.environ, KVPOOL_GO_COPY_BENCH=json.dumps(spec), **env), capture_output=True,
                           text=True, timeout=300)
        line = next((l for l in r.stdout.splitlines() if l.startswith("{")), None)
        if r.returncode != 0 or line is None:
            failures.append("Go client run" + label)
            print("gpu py check: Go client%s failed:\n%s\n%s" % (label, r.stdout[-2000:], r.stderr[-2000:]))
            return None
        j = json.loads(line)
        rows.append(("Go client (%s%s)" % (j["backend"], label), (j["offload_s"], j["reload_s"])))
        enqueued[rows[-1][0]] = (j["offload_enqueue_s"], j["reload_enqueue_s"])
        return rows[-1][1]

    go = None
    if a.go_bin:
        go = go_client("", {})
        # The same with every copy on the copy engine (no copy kernel), for
        # the kernel's gain in this run.
        go_client(", copy engine only", {"KVPOOL_COPY_KERNEL": "off"})

    # The seed's doc, literally: per page cpu[:, i].copy_(gpu[:, j], non_blocking=True)
    # on a side stream, into one pinned tensor.
    cpu = torch.zeros((regions, a.pages) + shape[2:], dtype=torch.bfloat16, pin_memory=cuda)
    if cuda:
        side = torch.cuda.Stream(dev)

        def t_off():
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for i, j in enumerate(src):
                    cpu[:, i].copy_(gpu[:, j], non_blocking=True)

        def t_rel():
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for i, j in enumerate(dst):
                    gpu[:, j].copy_(cpu[:, i], non_blocking=True)
        wait = side.synchronize
    else:
        def t_off():
            for i, j in enumerate(src):
                cpu[:, i].copy_(gpu[:, j])

        def t_rel():
            for i, j in enumerate(dst):
                gpu[:, j].copy_(cpu[:, i])

        def wait():
            pass
    base = timed(t_off, t_rel, wait, "torch baseline (seed doc)")
    rows.append(("torch baseline (seed doc)", base))

    gbps = lambda s: batch_bytes / s / 1e9
    lines = ["| client | direction | GB/s | x torch baseline | x Go client | ms a batch | of it enqueueing |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, (o, r) in rows:
        eo, er = enqueued.get(name, (None, None))
        for d, s, bs, gs, e in (("DtoH", o, base[0], go[0] if go else None, eo),
                                ("HtoD", r, base[1], go[1] if go else None, er)):
            lines.append("| %s | %s | %.2f | %.2f | %s | %.2f | %s |" % (name, d, gbps(s), bs / s, "%.2f" % (gs / s) if gs else "-",
                                                                   s * 1e3, "%.2f" % (e * 1e3) if e is not None else "-"))
    head = ("Python client side by side (%s, torch %s): %d pages of %d regions x %d bytes (%.1f MiB a batch), "
            "%d device pages, median of %d" % ("CUDA " + torch.cuda.get_device_name(dev) if cuda else "simulator, CPU tensors",
                                              torch.__version__, a.pages, regions, page_bytes, batch_bytes / 2**20,
                                              a.device_pages, a.reps))
    table = head + "\n\n" + "\n".join(lines) + "\n"
    goals = []
    if go:
        goals.append("kvpool Python vs torch baseline: DtoH %.1fx, HtoD %.1fx (goal >= 5x)" % (base[0] / py[0], base[1] / py[1]))
        goals.append("kvpool Python vs Go client: DtoH %.2f, HtoD %.2f (goal >= 0.90)" % (go[0] / py[0], go[1] / py[1]))
    table += "\n" + "\n".join("- " + g for g in goals) + "\n"
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "python-table.md"), "w") as f:
        f.write(table)
    print(table)
    if failures:
        print("GPU-PY-FAIL: %s" % ", ".join(failures))
        sys.exit(1)
    print("GPU-PY-OK")


if __name__ == "__main__":
    main()
