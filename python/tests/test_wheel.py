"""The wheel: built by build_wheel.py, installed by pip into a fresh
directory, imported from there with the library it ships (no
KVPOOL_LIBRARY), and used for one byte round trip against the agent."""

import os
import subprocess
import sys
import zipfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

PROGRAM = r"""
import numpy as np, kvpool, os
assert os.path.dirname(kvpool.__file__).startswith(os.environ["SITE"]), kvpool.__file__
kv = np.zeros((2, 16, 128), dtype=np.uint8)
kv[:] = np.arange(kv.size, dtype=np.uint64).reshape(kv.shape) % 251
want = kv[:, [1, 2]].copy()
p = kvpool.CPUPagePool(None, kv, 4)
assert p.offload_stream("w", "l", kv, [1, 2], 3, 4)
p.sync(); p._stream_synchronize()
kv[:, 5:7] = 0
st = p.reload_stream("w", "l", kv, [5, 6])
p.sync(); p._stream_synchronize()
assert (kv[:, 5:7] == want).all() and st.stored_len == 3
print("WHEEL OK")
"""


def test_wheel_installs_and_works(agent, library, tmp_path):
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0:
        pytest.skip("no pip for %s (apt-get install python3-pip)" % sys.executable)
    r = subprocess.run([sys.executable, os.path.join(os.path.dirname(HERE), "build_wheel.py"), "--lib", library,
                        "--out", str(tmp_path / "dist")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    whl = r.stdout.strip().splitlines()[-1]
    assert os.path.basename(whl).startswith("kvpool-") and "-py3-none-manylinux_" in whl, whl
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
    assert {"kvpool/__init__.py", "kvpool/libkvpool.so", "kvpool/kvpool.h"} <= names
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--no-compile",
                        "--target", str(site), whl], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    env = agent.env()
    env.pop("KVPOOL_LIBRARY", None)
    env["PYTHONPATH"] = str(site)
    env["SITE"] = str(site)
    r = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, cwd=str(tmp_path))
    assert "WHEEL OK" in r.stdout, r.stdout + r.stderr
