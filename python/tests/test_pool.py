"""The seed's CPUPagePool surface against a real standalone agent process,
with CPU tensors (or numpy arrays) as simulated device memory."""

import dataclasses
import inspect
import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import run_client
from helpers import as_bytes, config, fill_random, make, np, torch

import kvpool


@pytest.fixture
def pools(agent):
    made = []

    def new(kv, max_pages, **over):
        p = kvpool.CPUPagePool(config(**over), kv, max_pages)
        made.append(p)
        return p

    yield new
    for p in made:
        p.close()


def settle(pool):
    """What an engine's kernel on the current stream would wait for."""
    pool.sync()
    pool._stream_synchronize()


# -- the surface ---------------------------------------------------------------

def test_surface_is_the_seeds():
    sig = inspect.signature(kvpool.CPUPagePool.__init__)
    assert list(sig.parameters) == ["self", "config", "kv_cache", "max_cpu_pages"]
    sig = inspect.signature(kvpool.CPUPagePool.offload_stream)
    assert list(sig.parameters) == ["self", "rid", "label", "gpu_kv_cache", "gpu_page_indices", "stored_len",
                                    "position", "released"]
    assert sig.parameters["released"].default == 0
    sig = inspect.signature(kvpool.CPUPagePool.reload_stream)
    assert list(sig.parameters) == ["self", "rid", "label", "gpu_kv_cache", "gpu_page_indices"]
    for name, params in {"discard": ["rid", "label"], "remove_request": ["rid"], "is_offloaded": ["rid"],
                         "labels": ["rid"], "num_pages": ["rid", "label"], "sync": []}.items():
        assert list(inspect.signature(getattr(kvpool.CPUPagePool, name)).parameters)[1:] == params, name
    assert isinstance(kvpool.CPUPagePool.num_free_pages, property)
    fields = [(f.name, f.default) for f in dataclasses.fields(kvpool.OffloadedStream)]
    assert fields == [("cpu_page_indices", dataclasses.MISSING), ("stored_len", dataclasses.MISSING),
                      ("position", dataclasses.MISSING), ("released", 0)]
    public = {n for n in dir(kvpool.CPUPagePool) if not n.startswith("_")}
    assert public == {"offload_stream", "reload_stream", "discard", "remove_request", "is_offloaded", "labels",
                      "num_pages", "num_free_pages", "sync", "close"}


# -- byte-exact round trips over layouts and dtypes ------------------------------

def layouts():
    out = []
    kinds = ["numpy"] + (["torch"] if torch is not None else [])
    for kind in kinds:
        dts = [np.float16, np.float32, np.int8, np.float64] if kind == "numpy" else \
            [torch.float16, torch.bfloat16, torch.float32, torch.int8]
        for dt in dts:
            out.append(pytest.param(kind, dt, "layer_major", id="%s-%s-layer_major" % (kind, dt)))
        dt = dts[0]
        for lay in ("kv_split", "page_major", "list", "padded", "object"):
            out.append(pytest.param(kind, dt, lay, id="%s-%s-%s" % (kind, dt, lay)))
    return out


def build(kind, dt, lay, pages=48):
    """Returns (kv_cache, tensors, page_axis) for a layout."""
    if lay == "layer_major":  # [layers, pages, tokens, heads*dim]
        t = make(kind, (3, pages, 4, 16), dt)
        return t, [t], 1
    if lay == "kv_split":  # [K/V, layers, pages, tokens, dim]: 4 regions
        t = make(kind, (2, 2, pages, 4, 8), dt)
        return t, [t], 2
    if lay == "page_major":  # [pages, layers, ...]: one region
        t = make(kind, (pages, 3, 32), dt)
        return t, [t], 0
    if lay == "list":  # per-layer [K/V, pages, ...]
        ts = [make(kind, (2, pages, 24), dt) for _ in range(3)]
        return ts, ts, 1
    if lay == "padded":  # pages 48 elements apart, 32 move
        base = make(kind, (2, pages, 48), dt)
        t = base[:, :, :32]
        return t, [t], 1
    if lay == "object":
        t = make(kind, (2, pages, 64), dt)

        class KV:
            tensor = t
        return KV(), [t], 1
    raise ValueError(lay)


@pytest.mark.parametrize("kind,dt,lay", layouts())
def test_round_trip_bytes(pools, kind, dt, lay):
    kv, ts, axis = build(kind, dt, lay)
    for i, t in enumerate(ts):
        fill_random(t, 100 + i)
    before = [as_bytes(t).copy() for t in ts]
    pool = pools(kv, 24, page_axis=axis)
    src = [5, 0, 17, 3, 40, 41, 42, 30]
    dst = [47, 12, 1, 2, 20, 21, 22, 33]
    assert pool.offload_stream("req-1", "main", kv, src, 123, 456, 7) is True
    settle(pool)
    for t in ts:  # the engine reuses the device pages: poison them
        np.moveaxis(as_bytes(t), axis, 0)[src] = 0xA5
        np.moveaxis(as_bytes(t), axis, 0)[dst] = 0x5A
    st = pool.reload_stream("req-1", "main", kv, dst)
    settle(pool)
    assert st.stored_len == 123 and st.position == 456 and st.released == 7
    assert len(st.cpu_page_indices) == len(src) and len(set(st.cpu_page_indices)) == len(src)
    for t, b in zip(ts, before):
        got = np.moveaxis(as_bytes(t), axis, 0)
        want = np.moveaxis(b, axis, 0)
        for s, d in zip(src, dst):
            assert (got[d] == want[s]).all(), "device page %d does not hold page %d's bytes" % (d, s)
        untouched = [p for p in range(got.shape[0]) if p not in src and p not in dst]
        assert (got[untouched] == want[untouched]).all(), "a page outside the reload changed"
    assert pool.num_free_pages == 24


def test_padding_between_pages_is_not_touched(pools):
    base = np.zeros((2, 16, 48), dtype=np.uint16)
    fill_random(base, 9)
    view = base[:, :, :32]
    pad = base[:, :, 32:].copy()
    pool = pools(view, 8)
    assert pool.offload_stream("r", "l", view, [1, 2], 0, 0)
    settle(pool)
    base[:, :, :32] = 0
    pool.reload_stream("r", "l", view, [1, 2])
    settle(pool)
    assert (base[:, :, 32:] == pad).all()


def test_indices_as_tensors(pools):
    kv = np.zeros((2, 32, 64), dtype=np.uint8)
    fill_random(kv, 3)
    want = kv[:, [4, 5, 6]].copy()
    pool = pools(kv, 8)
    assert pool.offload_stream("r", "a", kv, np.array([4, 5, 6], dtype=np.int64), 0, 0)
    settle(pool)
    dst = [7, 8, 9]
    if torch is not None:
        dst = torch.tensor(dst, dtype=torch.int64)
    st = pool.reload_stream("r", "a", kv, dst)
    settle(pool)
    assert (kv[:, 7:10] == want).all()
    assert isinstance(st.cpu_page_indices, list) and all(isinstance(i, int) for i in st.cpu_page_indices)


# -- every method ----------------------------------------------------------------

def test_bookkeeping(pools):
    kv = np.zeros((2, 64, 32), dtype=np.uint8)
    pool = pools(kv, 20)
    assert pool.num_free_pages == 20
    assert pool.offload_stream("r1", "g0", kv, [0, 1, 2], 10, 11) is True
    assert pool.offload_stream("r1", "g1", kv, [3, 4], 20, 21, 1) is True
    assert pool.offload_stream("r2", "g0", kv, [5], 30, 31) is True
    assert pool.labels("r1") == ["g0", "g1"]
    assert pool.labels("r2") == ["g0"]
    assert pool.labels("nobody") == []
    assert pool.num_pages("r1", "g0") == 3 and pool.num_pages("r1", "g1") == 2
    assert pool.num_pages("r1", "none") == 0  # the seed engine's reading: unknown is 0
    assert pool.is_offloaded("r1") and pool.is_offloaded("r2") and not pool.is_offloaded("r3")
    assert pool.num_free_pages == 14
    pool.discard("r1", "g1")
    assert pool.labels("r1") == ["g0"] and pool.num_free_pages == 16
    pool.discard("r1", "g1")  # unknown: a no-op, as the seed's engine relies on
    pool.discard("never", "x")
    assert pool.num_free_pages == 16
    pool.remove_request("r1")
    assert not pool.is_offloaded("r1") and pool.num_free_pages == 19
    pool.remove_request("r1")  # unknown rid: a no-op
    st = pool.reload_stream("r2", "g0", kv, [9])
    assert (st.stored_len, st.position, st.released) == (30, 31, 0)
    pool._synchronize()
    assert pool.num_free_pages == 20 and not pool.is_offloaded("r2")
    assert pool.offload_stream("r4", "g0", kv, [], 1, 1) is False  # zero pages: False, nothing recorded
    assert not pool.is_offloaded("r4") and pool.num_free_pages == 20


def test_many_labels_grow_the_buffers(pools):
    kv = np.zeros((1, 128, 16), dtype=np.uint8)
    pool = pools(kv, 128)
    names = ["label-%03d-%s" % (i, "x" * 60) for i in range(100)]
    for i, n in enumerate(names):
        assert pool.offload_stream("big", n, kv, [i], 0, 0)
    assert pool.labels("big") == names
    assert pool.labels("big") == names  # the grown buffers again
    pool.remove_request("big")


def test_unicode_and_odd_names(pools):
    kv = np.zeros((1, 8, 16), dtype=np.uint8)
    pool = pools(kv, 8)
    for rid, label in [("rÉq-ü", "λ"), ("a\x00b", "nul\x00inside"), ("x" * 1024, "y" * 1024)]:
        assert pool.offload_stream(rid, label, kv, [1], 0, 0)
        assert pool.labels(rid) == [label] and pool.num_pages(rid, label) == 1
        pool.remove_request(rid)


def test_two_threads_share_a_pool(pools):
    """Two Python threads calling one pool at once: each gets its own
    answers (reload metadata, host pages, labels, counts, error messages),
    as the result buffers and kvpool_last_error are per thread."""
    import threading

    kv = np.zeros((2, 64, 32), dtype=np.uint8)
    fill_random(kv, 5)
    pool = pools(kv, 40)
    errs = []
    barrier = threading.Barrier(2)

    def worker(i):
        try:
            n = 3 + 5 * i  # 3 and 8 pages: a mixed-up answer shows in the counts
            pages = list(range(32 * i, 32 * i + n))
            back = list(range(32 * i + 16, 32 * i + 16 + n))
            rid = "thread-%d" % i
            barrier.wait()
            for it in range(500):
                assert pool.offload_stream(rid, "l%d" % i, kv, pages, 100 * i + it, 7 * i, i)
                assert pool.num_pages(rid, "l%d" % i) == n
                assert pool.labels(rid) == ["l%d" % i]
                st = pool.reload_stream(rid, "l%d" % i, kv, back)
                assert (len(st.cpu_page_indices), st.stored_len, st.position, st.released) == \
                    (n, 100 * i + it, 7 * i, i), (i, it, st)
                # Each thread fails in its own way and reads its own message.
                if i == 0:
                    with pytest.raises(KeyError) as ei:
                        pool.reload_stream(rid, "gone", kv, back)
                    assert "gone" in str(ei.value) or "unknown" in str(ei.value).lower(), str(ei.value)
                else:
                    with pytest.raises(kvpool.DuplicateIndexError) as ei:
                        pool.offload_stream(rid, "dup", kv, [1, 1], 0, 0)
                    assert "duplicate" in str(ei.value).lower(), str(ei.value)
        except BaseException as e:  # noqa: B902 - reported by the main thread
            errs.append((i, e))

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errs, errs
    pool._synchronize()
    assert pool.num_free_pages == 40


# -- all or nothing --------------------------------------------------------------

def test_full_pool_changes_nothing(pools):
    kv = np.zeros((2, 64, 64), dtype=np.uint8)
    fill_random(kv, 11)
    pool = pools(kv, 10)
    assert pool.offload_stream("a", "x", kv, list(range(8)), 1, 1)
    settle(pool)
    want = kv.copy()
    assert pool.offload_stream("b", "x", kv, list(range(10, 13)), 2, 2) is False
    assert pool.num_free_pages == 2
    assert not pool.is_offloaded("b") and pool.labels("b") == [] and pool.num_pages("b", "x") == 0
    # A stream of the same request that would not fit leaves the others alone.
    assert pool.offload_stream("a", "y", kv, list(range(20, 23)), 3, 3) is False
    assert pool.labels("a") == ["x"]
    settle(pool)
    assert (kv == want).all()
    # Exactly what fits does.
    assert pool.offload_stream("b", "x", kv, [30, 31], 2, 2) is True
    assert pool.num_free_pages == 0
    assert pool.offload_stream("c", "x", kv, [40], 2, 2) is False


# -- errors ------------------------------------------------------------------------

def test_misuse_raises_and_changes_nothing(pools):
    kv = np.zeros((2, 32, 64), dtype=np.uint8)
    fill_random(kv, 21)
    pool = pools(kv, 16)
    assert pool.offload_stream("r", "a", kv, [1, 2, 3], 5, 6)
    settle(pool)
    want = kv[:, [1, 2, 3]].copy()
    other = np.zeros((2, 32, 64), dtype=np.uint8)
    cases = [
        ("reload unknown stream", KeyError, lambda: pool.reload_stream("r", "zz", kv, [4])),
        ("reload unknown rid", kvpool.UnknownStreamError, lambda: pool.reload_stream("q", "a", kv, [4])),
        ("duplicate stream", kvpool.DuplicateStreamError, lambda: pool.offload_stream("r", "a", kv, [9], 0, 0)),
        ("index out of range", IndexError, lambda: pool.offload_stream("s", "a", kv, [32], 0, 0)),
        ("negative index", IndexError, lambda: pool.offload_stream("s", "a", kv, [-1], 0, 0)),
        ("duplicate index", kvpool.DuplicateIndexError, lambda: pool.offload_stream("s", "a", kv, [4, 4], 0, 0)),
        ("reload page count", kvpool.PageCountError, lambda: pool.reload_stream("r", "a", kv, [4, 5])),
        ("reload index range", IndexError, lambda: pool.reload_stream("r", "a", kv, [4, 5, 99])),
        ("reload duplicate index", ValueError, lambda: pool.reload_stream("r", "a", kv, [4, 4, 5])),
        ("empty rid", kvpool.BadNameError, lambda: pool.offload_stream("", "a", kv, [4], 0, 0)),
        ("long rid", ValueError, lambda: pool.offload_stream("x" * 5000, "a", kv, [4], 0, 0)),
        ("negative stored_len", kvpool.BadSizeError, lambda: pool.offload_stream("s", "a", kv, [4], -1, 0)),
        ("rid not a str", TypeError, lambda: pool.offload_stream(7, "a", kv, [4], 0, 0)),
        ("label not a str", TypeError, lambda: pool.num_pages("r", None)),
        ("index not an int", ValueError, lambda: pool.offload_stream("s", "a", kv, ["x"], 0, 0)),
        ("index beyond 32 bits", ValueError, lambda: pool.offload_stream("s", "a", kv, [1 << 40], 0, 0)),
        ("float indices", ValueError, lambda: pool.offload_stream("s", "a", kv, np.array([1.0]), 0, 0)),
        ("another kv cache", kvpool.LayoutError, lambda: pool.offload_stream("s", "a", other, [4], 0, 0)),
        ("another kv cache on reload", kvpool.LayoutError, lambda: pool.reload_stream("r", "a", other, [4, 5, 6])),
    ]
    for name, exc, fn in cases:
        with pytest.raises(exc) as ei:
            fn()
        assert str(ei.value), name
        assert pool.num_free_pages == 13, name
        assert pool.labels("r") == ["a"] and pool.num_pages("r", "a") == 3, name
        assert not pool.is_offloaded("s"), name
    # The stream is intact: it reloads byte for byte.
    kv[:, 10:13] = 0
    st = pool.reload_stream("r", "a", kv, [10, 11, 12])
    settle(pool)
    assert (st.stored_len, st.position) == (5, 6)
    assert (kv[:, 10:13] == want).all()


def test_same_layout_through_another_object_is_accepted(pools):
    kv = np.zeros((2, 16, 64), dtype=np.uint8)
    pool = pools(kv, 8)
    assert pool.offload_stream("r", "a", kv[:], [1], 0, 0)  # a new view of the same memory
    pool.reload_stream("r", "a", kv[...], [2])


@pytest.mark.parametrize("name,make_kv,msg", [
    ("every other element", lambda: np.zeros((4, 8, 16), dtype=np.uint8)[:, :, ::2], "contiguous"),
    ("transposed", lambda: np.zeros((4, 8, 16), dtype=np.uint8).transpose(0, 2, 1), "contiguous"),
    ("interleaved pages", lambda: np.lib.stride_tricks.as_strided(np.zeros(1000, np.uint8), (2, 8, 16), (200, 8, 1)),
     "interleave"),
    ("broadcast", lambda: np.broadcast_to(np.zeros((1, 8, 16), dtype=np.uint8), (4, 8, 16)), "broadcast"),
    ("negative stride", lambda: np.zeros((4, 8, 16), dtype=np.uint8)[::-1], "negative"),
    ("no page axis", lambda: np.zeros((8,), dtype=np.uint8), "page axis"),
    ("empty list", lambda: [], "empty"),
    ("mixed pages", lambda: [np.zeros((2, 8, 4), np.uint8), np.zeros((2, 9, 4), np.uint8)], "pages"),
    ("not a tensor", lambda: "kv", "neither"),
])
def test_layouts_it_cannot_express(agent, name, make_kv, msg):
    with pytest.raises(kvpool.LayoutError, match=msg):
        kvpool.CPUPagePool(config(), make_kv(), 4)


def test_bad_construction(agent):
    kv = np.zeros((2, 8, 16), dtype=np.uint8)
    with pytest.raises(ValueError, match="max_cpu_pages"):
        kvpool.CPUPagePool(config(), kv, 0)
    with pytest.raises(ValueError, match="unknown config.kvpool keys"):
        kvpool.CPUPagePool({"kvpool": {"sockett": "x"}}, kv, 4)
    with pytest.raises(kvpool.UnauthorizedError):
        kvpool.CPUPagePool(config(token="not-a-token"), kv, 4)
    with pytest.raises(PermissionError):
        kvpool.CPUPagePool(config(token="not-a-token"), kv, 4)
    with pytest.raises(kvpool.DisconnectedError):
        kvpool.CPUPagePool(config(socket="/nonexistent/kvpool.sock"), kv, 4)
    with pytest.raises(kvpool.LayoutError, match="simulator"):
        kvpool.CPUPagePool(config(backend="cuda"), kv, 4)
    with pytest.raises(kvpool.InvalidArgumentError, match="spin_wait_us"):
        kvpool.CPUPagePool(config(spin_wait_us=1001), kv, 4)


@pytest.mark.parametrize("spin", [-1, 0, 1000])
def test_spin_wait(pools, spin):
    # Whether a call polls for the reply or sleeps at once, the bytes and
    # answers are the same.
    kv = np.zeros((2, 8, 16), dtype=np.uint8)
    fill_random(kv, spin + 7)
    want = kv[:, [2, 3]].copy()
    pool = pools(kv, 4, spin_wait_us=spin)
    assert pool.offload_stream("r", "a", kv, [2, 3], 5, 6)
    settle(pool)
    s = pool.reload_stream("r", "a", kv, [0, 1])
    settle(pool)
    assert (s.stored_len, s.position) == (5, 6)
    assert (kv[:, 0:2] == want).all()


def test_config_object_overrides(agent):
    class Cfg:
        class kvpool:
            sim_copy_delay_us = 1000
            name = "from-an-object"
    kv = np.zeros((2, 8, 16), dtype=np.uint8)
    p = kvpool.CPUPagePool(Cfg(), kv, 4)
    assert p._info()["capacity"] == 4
    p.close()
    with pytest.raises(kvpool.SessionClosedError):
        p.num_free_pages
    p.close()  # twice is fine


def test_reconnect_resumes(pools):
    kv = np.zeros((2, 16, 64), dtype=np.uint8)
    fill_random(kv, 4)
    want = kv[:, [1, 2]].copy()
    pool = pools(kv, 8)
    assert pool.offload_stream("r", "a", kv, [1, 2], 3, 4)
    settle(pool)
    pool._disconnect()
    assert pool.labels("r") == ["a"]  # reconnected and resumed
    pool.reload_stream("r", "a", kv, [5, 6])
    settle(pool)
    assert (kv[:, 5:7] == want).all()


# -- ordering, processes -------------------------------------------------------------

def test_sync_orders_the_stream(agent):
    r = run_client(agent, "sync_order", 300000)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["right_after_sync"]
    if res["checked_after_s"] < res["delay_s"]:
        assert res["stale_before_sync"], "the bytes were there before sync(): the check would pass by luck"


def test_two_processes(agent):
    procs = [subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "clients.py"), "roundtrip",
                               str(gpu), "25", str(seed)], env=agent.env(token), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for gpu, token, seed in [(0, agent.tokens[1], 1), (1, agent.tokens[1], 2)]]
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0 and out.startswith("OK"), out + err


def test_busy_while_another_process_holds_the_gpu(agent):
    holder = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "clients.py"), "hold", "1", "8"],
                              env=agent.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = holder.stdout.readline()
        assert line.startswith("READY"), line + holder.stderr.read()
        r = run_client(agent, "open_only", 1)
        assert "ERROR BusyError" in r.stdout, r.stdout + r.stderr
    finally:
        holder.kill()
        holder.wait()


def test_killed_client_pages_come_back(agent):
    holder = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "clients.py"), "hold", "1", "8"],
                              env=agent.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = holder.stdout.readline()
    assert line.startswith("READY 0"), line + holder.stderr.read()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    r = run_client(agent, "open_only", 1)
    assert r.stdout.startswith("OPENED 8 False 8"), r.stdout + r.stderr
    assert agent.proc.poll() is None, "the agent died"


def test_fork_after_load_fails_clearly_in_the_child(agent):
    r = run_client(agent, "fork_child")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "CHILD RuntimeError" in r.stdout and "fork" in r.stdout
    assert "PARENT still works: True" in r.stdout


def test_missing_library_is_a_clear_error(agent):
    r = subprocess.run([sys.executable, "-c", "import numpy, kvpool; kvpool.CPUPagePool(None, numpy.zeros((1,4,4)), 1)"],
                       env=agent.env(KVPOOL_LIBRARY="/nonexistent/libkvpool.so"), capture_output=True, text=True)
    assert r.returncode != 0 and "does not exist" in r.stderr and "KVPOOL_LIBRARY" in r.stderr, r.stderr


def test_locality(agent):
    """The pool says where its host memory lies relative to its GPU: every
    chunk counted once (local, remote or unknown), each chunk's node, and
    the ranks the pod's host KV is shared among (declared here)."""
    kv = np.zeros((2, 8, 16), dtype=np.uint8)
    p = kvpool.CPUPagePool(config(ranks=1), kv, 4)
    try:
        loc = kvpool.locality(p)
        assert set(loc) == {"gpu_numa", "ranks", "local", "remote", "unknown", "chunk_numa"}
        assert loc["ranks"] == 1
        assert len(loc["chunk_numa"]) == loc["local"] + loc["remote"] + loc["unknown"] >= 1
        assert loc["remote"] == 0  # one NUMA node of the simulated GPUs' host
        assert all(n == loc["gpu_numa"] or n == -1 or loc["gpu_numa"] == -1 for n in loc["chunk_numa"])
    finally:
        p.close()
    with pytest.raises(kvpool.InvalidArgumentError):
        kvpool.CPUPagePool(config(ranks=-1), kv, 4)
