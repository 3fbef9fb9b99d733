"""Fixtures: a real standalone kvpool agent process, and the library.

The agent binary is $KVPOOL_AGENT_BIN, else built with `go build ./cmd/agent`;
the library is $KVPOOL_LIBRARY, else python/kvpool/libkvpool.so, else built
with `go build -buildmode=c-shared`. Without Go and without them, the suite
skips, saying why."""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PYROOT = os.path.dirname(HERE)
REPO = os.path.dirname(PYROOT)
sys.path.insert(0, PYROOT)

TOKENS = ("tok-a", "tok-b")


def _go():
    for g in (shutil.which("go"), "/usr/local/go/bin/go"):
        if g and os.path.exists(g):
            return g
    return None


def _build(what, out, *args):
    go = _go()
    if go is None:
        pytest.skip("no %s: set %s, or install Go to build it" % (what, "KVPOOL_AGENT_BIN" if "agent" in what else "KVPOOL_LIBRARY"))
    env = dict(os.environ)
    env.pop("GOFLAGS", None)
    r = subprocess.run([go, "build", "-o", out] + list(args), cwd=REPO, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail("building %s failed:\n%s" % (what, r.stderr))
    return out


@pytest.fixture(scope="session")
def workdir():
    d = tempfile.mkdtemp(prefix="kvpool-pytest-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def library(workdir):
    p = os.environ.get("KVPOOL_LIBRARY")
    if not p:
        p = os.path.join(PYROOT, "kvpool", "libkvpool.so")
        if not os.path.exists(p):
            p = _build("libkvpool.so", os.path.join(workdir, "libkvpool.so"), "-buildmode=c-shared", "./cmd/libkvpool")
    os.environ["KVPOOL_LIBRARY"] = p
    return p


class Agent:
    def __init__(self, proc, socket, tokens, log):
        self.proc, self.socket, self.tokens, self.log = proc, socket, tokens, log

    def env(self, token=None, **extra):
        e = dict(os.environ)
        e["KVPOOL_SOCKET"] = self.socket
        e["KVPOOL_TOKEN"] = token or self.tokens[0]
        e["PYTHONPATH"] = PYROOT + os.pathsep + e.get("PYTHONPATH", "")
        e["KVPOOL_TESTS_NUMPY_ONLY"] = "1"
        e.update(extra)
        return e


def start_agent(binary, workdir, name):
    xdg = os.path.join(workdir, name + ".xdg")
    os.makedirs(xdg, exist_ok=True)
    log = os.path.join(workdir, name + ".log")
    args = [binary, "--standalone", "--chunk-mib", "4", "--chunks-per-gpu", "4", "--standalone-gpus", "2",
            "--standalone-tokens", ",".join(TOKENS)]
    env = dict(os.environ, XDG_RUNTIME_DIR=xdg)
    f = open(log, "w")
    proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 60
    socket, tokens = None, []
    while time.time() < deadline:
        text = open(log).read()
        m = re.search(r'msg="kvpool agent serving".* socket=(\S+)', text)
        if m:
            socket = m.group(1)
            tokens = re.findall(r"msg=allocation token=(\S+)", text)
            break
        if proc.poll() is not None:
            pytest.fail("the agent exited with %s:\n%s" % (proc.returncode, text))
        time.sleep(0.05)
    if socket is None:
        proc.kill()
        pytest.fail("the agent did not log its socket within 60 s:\n" + open(log).read())
    assert sorted(tokens) == sorted(TOKENS), "tokens logged: %s" % tokens
    return Agent(proc, socket, list(TOKENS), log)


@pytest.fixture(scope="session")
def agent_bin(workdir):
    return os.environ.get("KVPOOL_AGENT_BIN") or _build("the agent", os.path.join(workdir, "agent"), "./cmd/agent")


@pytest.fixture(scope="session")
def agent(agent_bin, library, workdir):
    a = start_agent(agent_bin, workdir, "agent")
    os.environ["KVPOOL_SOCKET"] = a.socket
    os.environ["KVPOOL_TOKEN"] = a.tokens[0]
    yield a
    a.proc.send_signal(signal.SIGTERM)
    try:
        a.proc.wait(20)
    except subprocess.TimeoutExpired:
        a.proc.kill()
        a.proc.wait()


def run_client(agent, script, *args, token=None, timeout=120, **env):
    """Runs tests/clients.py SCRIPT in a new Python process."""
    return subprocess.run([sys.executable, os.path.join(HERE, "clients.py"), script] + [str(a) for a in args],
                          env=agent.env(token, **env), capture_output=True, text=True, timeout=timeout)
