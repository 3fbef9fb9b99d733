#!/usr/bin/env python3
"""Builds the kvpool wheel: the pure-Python package plus libkvpool.so.

    python3 python/build_wheel.py [--lib PATH] [--out DIR]

Without --lib it builds the library with `go build -buildmode=c-shared
-trimpath -ldflags='-s -w' ./cmd/libkvpool` (Go and gcc needed, no CUDA).
The wheel is py3-none-<platform>: the package is pure Python over ctypes,
so one wheel serves every CPython 3.8+, but the library is native code for
one platform.

manylinux policy, stated plainly: the tag is manylinux_<X>_<Y>_<arch>, where
glibc X.Y is the newest glibc symbol version the built library actually
references (read from its dynamic symbol table), not the build machine's
glibc. The library links only libc (it dlopens libcuda.so.1 at run time).
Built on Debian 12 (glibc 2.36) with Go 1.26 that is glibc 2.34, so
manylinux_2_34_x86_64: installable on glibc 2.34 and newer (Debian 12,
Ubuntu 22.04, RHEL 9), not on older ones. No auditwheel run: there are no
shared libraries to vendor. Standard library only."""

import argparse
import base64
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
NAME = "kvpool"


def version():
    src = open(os.path.join(HERE, NAME, "__init__.py")).read()
    return re.search(r'__version__ = "([^"]+)"', src).group(1)


def build_library(out):
    env = dict(os.environ, CGO_ENABLED="1", GOFLAGS="")
    go = shutil.which("go") or "/usr/local/go/bin/go"
    subprocess.run([go, "build", "-buildmode=c-shared", "-trimpath", "-ldflags=-s -w", "-o", out, "./cmd/libkvpool"],
                   cwd=REPO, env=env, check=True)


def glibc_needed(lib):
    """The newest GLIBC_x.y symbol version lib references."""
    try:
        out = subprocess.run(["objdump", "-T", lib], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        sys.exit("build_wheel: objdump could not read %s (%s); install binutils" % (lib, e))
    vs = {tuple(int(x) for x in m.split(".")) for m in re.findall(r"GLIBC_([0-9]+(?:\.[0-9]+)+)", out)}
    if not vs:
        sys.exit("build_wheel: %s references no glibc symbol versions" % lib)
    return max(vs)[:2]


def platform_tag(lib):
    machine = platform.machine()
    if sys.platform != "linux":
        sys.exit("build_wheel: Linux only (the agent and its socket are Linux)")
    major, minor = glibc_needed(lib)
    return "manylinux_%d_%d_%s" % (major, minor, machine)


def record_line(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "%s,sha256=%s,%d" % (path, digest, len(data))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", help="a built libkvpool.so to ship instead of building one")
    ap.add_argument("--out", default=os.path.join(HERE, "dist"))
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="kvpool-wheel-")
    try:
        lib = a.lib
        if not lib:
            lib = os.path.join(tmp, "libkvpool.so")
            build_library(lib)
        ver = version()
        tag = "py3-none-" + platform_tag(lib)
        dist_info = "%s-%s.dist-info" % (NAME, ver)
        files = []
        for f in sorted(os.listdir(os.path.join(HERE, NAME))):
            if f.endswith(".py"):
                files.append(("%s/%s" % (NAME, f), open(os.path.join(HERE, NAME, f), "rb").read()))
        files.append(("%s/libkvpool.so" % NAME, open(lib, "rb").read()))
        files.append(("%s/kvpool.h" % NAME, open(os.path.join(REPO, "cmd", "libkvpool", "kvpool.h"), "rb").read()))
        readme = open(os.path.join(HERE, "README.md")).read()
        meta = ("Metadata-Version: 2.1\nName: %s\nVersion: %s\nSummary: The seed's CPUPagePool served by the kvpool "
                "node agent (host-memory KV cache tier)\nRequires-Python: >=3.8\nLicense: Apache-2.0\n"
                "Description-Content-Type: text/markdown\n\n%s" % (NAME, ver, readme)).encode()
        wheel = ("Wheel-Version: 1.0\nGenerator: kvpool build_wheel.py\nRoot-Is-Purelib: false\nTag: %s\n" % tag).encode()
        files.append(("%s/METADATA" % dist_info, meta))
        files.append(("%s/WHEEL" % dist_info, wheel))
        record = [record_line(p, d) for p, d in files] + ["%s/RECORD,," % dist_info]
        files.append(("%s/RECORD" % dist_info, ("\n".join(record) + "\n").encode()))
        os.makedirs(a.out, exist_ok=True)
        path = os.path.join(a.out, "%s-%s-%s.whl" % (NAME, ver, tag))
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
            for p, d in files:
                zi = zipfile.ZipInfo(p, date_time=(2026, 1, 1, 0, 0, 0))
                zi.external_attr = (0o755 if p.endswith(".so") else 0o644) << 16
                zi.compress_type = zipfile.ZIP_DEFLATED
                z.writestr(zi, d)
        print(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
