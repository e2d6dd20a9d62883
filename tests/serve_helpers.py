"""A real `celeris serve` in a subprocess on a free loopback port, for the serve tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}  # one torch thread: CI has 2 cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def celeris(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """The real `celeris` CLI in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "celeris_cli", *args], env=ENV, capture_output=True, text=True, timeout=timeout
    )


class Server:
    """`celeris serve ARGS` on a free port, ready when /health answers."""

    def __init__(self, *args: str, key: str | None = None, log: Path | None = None) -> None:
        self.args = args
        self.key = key
        self.port = free_port()
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120) -> Server:
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115 - closed with the process
        cmd = [sys.executable, "-m", "celeris_cli", "serve", "--port", str(self.port), *self.args]
        self.proc = subprocess.Popen(cmd, env=ENV, stdout=out, stderr=out)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"celeris serve exited with {self.proc.returncode}")
            try:
                self.get("/health")
                return self
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        raise AssertionError("celeris serve did not answer /health in time")

    def get(self, path: str, key: str | None = None) -> Any:
        req = urllib.request.Request(self.url + path)
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read()) if "json" in r.headers.get("content-type", "") else r.read().decode()

    def post(self, path: str, body: bytes, key: str | None = None) -> tuple[int, Any]:
        """(status, JSON body) of a raw POST, errors included."""
        req = urllib.request.Request(self.url + path, data=body, method="POST")
        req.add_header("Content-Type", "application/json")
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def client(self, key: str | None = None, **kw: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or self.key or "none", max_retries=0, **kw)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def wait_for(predicate: Any, timeout: float = 120.0, every: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(every)


class Watch:
    """`celeris watch CONFIG` in a subprocess: the queue's daemon beside the server."""

    def __init__(self, config: Path, log: Path) -> None:
        self.config = config
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Watch:
        out = open(self.log, "ab")  # noqa: SIM115 - closed with the process
        cmd = [sys.executable, "-m", "celeris_cli", "watch", str(self.config)]
        self.proc = subprocess.Popen(cmd, env=ENV, stdout=out, stderr=out)
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
