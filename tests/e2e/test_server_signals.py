"""`moestream serve` under signals and engine death (issue 16), on the demo model.

- SIGTERM / SIGINT while the model loads: exit within seconds, no engine process left.
- The engine process killed while a stream runs: the stream gets a final error event, /health stops
  answering 200, and the server exits with status 1 (documented in moestream/server/launch.py:
  a supervisor restarts the whole server; it never keeps the port to answer 503 forever).
Idle SIGTERM is tests/e2e/test_server_e2e.py::test_sigterm_stops_server_and_engine; SIGTERM while
streaming ends tests/e2e/test_server_hostile.py.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from test_server_e2e import _pid_alive, free_port, port_is_free, start_server


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_signal_while_loading_exits_promptly(tmp_path, sig, code):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moestream.cli", "serve", "--model-path", "demo", "--port",
                             str(port), "--device", "cpu", "--dtype", "float32"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(tmp_path)})
    deadline = time.time() + 60
    while time.time() < deadline and not _children(proc.pid):  # the engine process exists: it is loading
        time.sleep(0.05)
    engines = _children(proc.pid)
    assert engines and proc.poll() is None
    time.sleep(0.5)
    t0 = time.perf_counter()
    proc.send_signal(sig)
    assert proc.wait(15) == code, proc.stderr.read()
    assert time.perf_counter() - t0 <= 10
    deadline = time.time() + 5
    while time.time() < deadline and any(_pid_alive(p) for p in engines):
        time.sleep(0.1)
    assert not any(_pid_alive(p) for p in engines)
    assert "Traceback" not in proc.stderr.read()
    assert port_is_free(port)


def test_engine_death_fails_streams_and_exits_nonzero(tmp_path):
    proc, port, log = start_server(["--model-path", "demo"], env={"XDG_CACHE_HOME": str(tmp_path)})
    url = f"http://127.0.0.1:{port}"
    try:
        engine_pid = httpx.get(url + "/v1/stats").json()["engine"]["pid"]
        lines: list[str] = []
        started = threading.Event()

        def stream():
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                    if line.startswith("data: "):
                        started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(30)
        os.kill(engine_pid, signal.SIGKILL)
        t.join(15)
        errors = [json.loads(line[6:]) for line in lines if line.startswith("data: {") and '"error"' in line]
        assert errors and "engine" in errors[-1]["error"]["message"] and lines[-1] == "data: [DONE]"
        assert proc.wait(15) == 1  # not a zombie front end answering 503
        assert port_is_free(port)
        log.seek(0)
        assert "engine process died" in log.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
