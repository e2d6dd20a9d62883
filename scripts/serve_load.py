"""Load figure for `celeris serve`: N concurrent clients against a real server on the embedded model, then
`celeris batch` on the same requests, in one run. Prints requests/s, output tokens/s, p50/p99 latency, the
server's resident memory before and after the load, and the server's output tokens/s as a share of
`celeris batch`'s (its decode time, the model's load excluded).

    python scripts/serve_load.py --clients 32 --requests 256 --max-tokens 32

Each request is a completion with its own seed; the server decodes waiting requests together. Everything
runs on this machine, against 127.0.0.1 only, and stops by itself.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

PROMPTS = ["The quick brown fox", "床前明月光，", "Shall I compare thee", "白日依山尽，", "To be, or not to be"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=600) as r:
        return dict(json.loads(r.read()))


def rss_mib(pid: int) -> float:
    """A process's resident memory (Linux's /proc; nan elsewhere)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text(encoding="utf-8")
    except OSError:
        return float("nan")
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")) / 1024


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"celeris serve exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url + "/health", timeout=5).read()
            return
        except OSError:
            time.sleep(0.3)
    sys.exit("celeris serve did not start in time")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--model", default="celeris-block")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch threads of both (OMP_NUM_THREADS)")
    args = ap.parse_args()
    env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
    bodies = [
        {"prompt": f"{PROMPTS[i % len(PROMPTS)]} {i}", "max_tokens": args.max_tokens, "seed": i}
        for i in range(args.requests)
    ]
    celeris = [sys.executable, "-m", "celeris_cli"]
    common = ["--model", args.model, "--device", "cpu", "--dtype", args.dtype, "--batch-size", str(args.batch_size)]

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([*celeris, "serve", "--port", str(port), *common], stderr=subprocess.DEVNULL, env=env)
    try:
        wait_ready(url, server)
        post(url + "/v1/completions", {"prompt": "warm up", "max_tokens": 8})
        rss_before = rss_mib(server.pid)
        latencies: list[float] = []
        tokens = [0]
        next_i = [0]
        lock = threading.Lock()

        def client() -> None:
            while True:
                with lock:
                    i = next_i[0]
                    next_i[0] += 1
                if i >= len(bodies):
                    return
                t0 = time.perf_counter()
                r = post(url + "/v1/completions", bodies[i])
                with lock:
                    latencies.append(time.perf_counter() - t0)
                    tokens[0] += r["usage"]["completion_tokens"]

        threads = [threading.Thread(target=client) for _ in range(args.clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        rss_after = rss_mib(server.pid)
        metrics = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
        rows = {k: float(v) for k, v in re.findall(r"^celeris_serve_batch_rows_(sum|count) (\S+)$", metrics, re.M)}
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)

    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "requests.jsonl", Path(tmp) / "results.jsonl"
        lines = [
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": b} for i, b in enumerate(bodies)
        ]
        src.write_text("".join(json.dumps(x) + "\n" for x in lines))
        run = subprocess.run(
            [*celeris, "batch", "-i", str(src), "-o", str(out), *common], capture_output=True, text=True, env=env
        )
        if run.returncode != 0:
            sys.exit(f"celeris batch failed: {run.stderr.strip().splitlines()[-1]}")
        m = re.search(r" in ([0-9.]+)s ", run.stderr)
        assert m, run.stderr
        batch_wall = float(m.group(1))
        batch_tokens = sum(json.loads(x)["response"]["body"]["usage"]["completion_tokens"] for x in out.open())

    lat = sorted(latencies)
    p99 = lat[min(len(lat) - 1, int(round(0.99 * (len(lat) - 1))))]
    serve_tps, batch_tps = tokens[0] / wall, batch_tokens / batch_wall
    load = os.getloadavg()[0]
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}, load average {load:.1f}")
    print(f"model {args.model} ({args.dtype}), {args.requests} requests, max_tokens {args.max_tokens}, ", end="")
    print(f"batch size {args.batch_size}, torch threads {args.threads or 'default'}")
    print(
        f"serve, {args.clients} clients: {len(lat) / wall:.2f} requests/s, {serve_tps:.1f} output tok/s, "
        f"p50 {statistics.median(lat):.2f} s, p99 {p99:.2f} s ({wall:.1f} s)"
    )
    print(f"serve's engine batches: {rows['count']:.0f}, {rows['sum'] / rows['count']:.1f} rows on average")
    print(f"serve's resident memory: {rss_before:.0f} MiB after warm-up, {rss_after:.0f} MiB after the load")
    print(f"celeris batch, same requests: {batch_tokens / batch_wall:.1f} output tok/s ({batch_wall:.1f} s)")
    print(f"serve / batch throughput: {serve_tps / batch_tps:.0%}")


if __name__ == "__main__":
    main()
