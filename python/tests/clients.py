"""Client processes the tests start: `python3 clients.py SCRIPT ARGS...`,
with KVPOOL_SOCKET and KVPOOL_TOKEN in the environment. Each prints what it
saw and exits 0 only when it held."""

import json
import os
import sys
import time

from helpers import as_bytes, fill_random, np

import kvpool


def sync_order(delay_us):
    """Reload onto poisoned pages: before sync() the engine's stream sees the
    poison, after sync() the bytes."""
    delay = int(delay_us)
    kv = np.zeros((2, 32, 256), dtype=np.uint8)
    fill_random(kv, 5)
    want = kv[:, [3, 4, 9]].copy()
    pool = kvpool.CPUPagePool({"kvpool": {"sim_copy_delay_us": delay}}, kv, 16)
    assert pool.offload_stream("r", "a", kv, [3, 4, 9], 7, 8)
    pool.sync()
    pool._stream_synchronize()  # the engine's stream, behind the offload
    kv[:, 20:23] = 0xEE
    t0 = time.monotonic()
    pool.reload_stream("r", "a", kv, [20, 21, 22])
    pool._stream_synchronize()  # nothing orders it behind the copy yet
    stale = bool((kv[:, 20:23] == 0xEE).all())
    early = time.monotonic() - t0
    pool.sync()
    pool._stream_synchronize()
    right = bool((kv[:, 20:23] == want).all())
    print(json.dumps({"stale_before_sync": stale, "checked_after_s": early, "delay_s": delay / 1e6,
                      "right_after_sync": right}))
    pool.close()
    return 0 if right else 1


def hold(gpu, pages):
    """Fill a session, report, then wait to be killed."""
    kv = np.zeros((2, 64, 1024), dtype=np.uint8)
    fill_random(kv, 1)
    pool = kvpool.CPUPagePool({"kvpool": {"device": int(gpu)}}, kv, int(pages))
    assert pool.offload_stream("held", "a", kv, list(range(int(pages))), 1, 2)
    pool._synchronize()
    print("READY", pool.num_free_pages, pool._info()["session"], flush=True)
    time.sleep(3600)


def roundtrip(gpu, iters, seed):
    """Round trips of random bytes on one GPU, checked byte for byte."""
    kv = np.zeros((3, 64, 512), dtype=np.uint8)
    pool = kvpool.CPUPagePool({"kvpool": {"device": int(gpu), "sim_copy_delay_us": 200}}, kv, 32)
    rng = np.random.default_rng(int(seed))
    for i in range(int(iters)):
        fill_random(kv, int(seed) * 1000 + i)
        src = rng.choice(32, size=8, replace=False).tolist()
        dst = (32 + rng.choice(32, size=8, replace=False)).tolist()
        want = kv[:, src].copy()
        assert pool.offload_stream("r%d" % i, "a", kv, src, i, i + 1, 0)
        pool.sync()
        pool._stream_synchronize()
        kv[:, dst] = 0
        pool.reload_stream("r%d" % i, "a", kv, dst)
        pool.sync()
        pool._stream_synchronize()
        if not (kv[:, dst] == want).all():
            print("MISMATCH at iteration", i)
            return 1
    print("OK", pool._info()["session"], pool.num_free_pages)
    pool.close()
    return 0


def open_only(gpu):
    kv = np.zeros((2, 16, 64), dtype=np.uint8)
    try:
        pool = kvpool.CPUPagePool({"kvpool": {"device": int(gpu), "timeout_s": 10}}, kv, 8)
    except kvpool.KVPoolError as e:
        print("ERROR", type(e).__name__, e)
        return 0
    print("OPENED", pool.num_free_pages, pool.is_offloaded("held"), pool._info()["capacity"])
    pool.close()
    return 0


def fork_child():
    kv = np.zeros((2, 16, 64), dtype=np.uint8)
    pool = kvpool.CPUPagePool(None, kv, 8)
    pid = os.fork()
    if pid == 0:
        try:
            pool.is_offloaded("x")
        except RuntimeError as e:
            os.write(1, ("CHILD RuntimeError %s\n" % e).encode())
            os._exit(0)
        os.write(1, b"CHILD no error\n")
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    print("PARENT still works:", pool.is_offloaded("x") is False, flush=True)
    pool.close()
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    fn = {"sync_order": sync_order, "hold": hold, "roundtrip": roundtrip, "open_only": open_only,
          "fork_child": fork_child}[sys.argv[1]]
    sys.exit(fn(*sys.argv[2:]) or 0)
