"""Layouts and byte helpers shared by the tests and tests/clients.py."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402

torch = None
if not os.environ.get("KVPOOL_TESTS_NUMPY_ONLY"):  # client processes skip torch's import time
    try:
        import torch  # noqa: E402
    except ImportError:  # numpy stands in
        pass

# Every pool of one process shares the simulator, so they share its options.
# The copy delay makes a missing sync show up as wrong bytes.
SIM_DELAY_US = 1000


def config(**kv):
    o = {"sim_copy_delay_us": SIM_DELAY_US}
    o.update(kv)
    return {"kvpool": o}


def as_bytes(t):
    """A writable uint8 numpy view of a CPU tensor or array (any dtype)."""
    if isinstance(t, np.ndarray):
        return t.view(np.uint8)
    return t.view(torch.uint8).numpy() if t.dtype != torch.bool else t.numpy().view(np.uint8)


def fill_random(t, seed):
    b = as_bytes(t)
    rng = np.random.default_rng(seed)
    b[...] = rng.integers(0, 256, size=b.shape, dtype=np.uint8)


def page_bytes_of(t, axis, page):
    """The bytes of one page (all leading indices) as a numpy array copy."""
    b = as_bytes(t)
    return np.take(b, page, axis=axis).copy()


def torch_dtypes():
    if torch is None:
        return []
    return [torch.float16, torch.bfloat16, torch.float32, torch.int8]


def make(kind, shape, dtype):
    if kind == "numpy":
        return np.zeros(shape, dtype=dtype)
    return torch.zeros(shape, dtype=dtype)
