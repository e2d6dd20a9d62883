"""Load figure for `celeris serve`: N concurrent clients against a real server on the embedded model, then
`celeris batch` on the same requests, in one run. Prints requests/s, output tokens/s, p50/p99 latency, the
server's resident memory (RSS) after its warm-up request and after the load (and its peak), and the
server's output tokens/s as a share of `celeris batch`'s (its decode time, the model's load excluded).

    python scripts/serve_load.py --clients 32 --requests 256 --max-tokens 32
    python scripts/serve_load.py --clients 4 --requests 8 --max-tokens 8 --no-batch   # the server alone
    python scripts/serve_load.py --batch-api --requests 160 --max-tokens 16             # one Batch API job

`--batch-api` sends the requests as one batch through `/v1/files` and `/v1/batches` instead, to a
`celeris serve --queue` with its `celeris watch` daemon on a queue in a temporary folder, and prints the
batch's wall time from create to `completed`, its requests/s and output tokens/s, and the server's RSS.

Every size is bounded (`LIMITS`) before anything is sized by it.

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

LIMITS = {"clients": 256, "requests": 10_000, "max_tokens": 512, "batch_size": 256, "threads": 256}
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


def rss_mb(pid: int) -> tuple[float, float]:
    """(resident, peak resident) MiB of a process, from /proc (Linux); (nan, nan) elsewhere."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return float("nan"), float("nan")
    kb = dict(re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", status, re.M))
    return int(kb.get("VmRSS", 0)) / 1024, int(kb.get("VmHWM", 0)) / 1024


def bounded(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name, most in LIMITS.items():
        value = getattr(args, name)
        if value is not None and not 1 <= value <= most:
            ap.error(f"--{name.replace('_', '-')} must be 1..{most}, got {value}")


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
    ap.add_argument("--no-batch", action="store_true", help="the server alone, without `celeris batch` after it")
    ap.add_argument("--batch-api", action="store_true", help="one Batch API job through serve --queue and watch")
    args = ap.parse_args()
    bounded(ap, args)
    env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
    bodies = [
        {"prompt": f"{PROMPTS[i % len(PROMPTS)]} {i}", "max_tokens": args.max_tokens, "seed": i}
        for i in range(args.requests)
    ]
    celeris = [sys.executable, "-m", "celeris_cli"]
    common = ["--model", args.model, "--device", "cpu", "--dtype", args.dtype, "--batch-size", str(args.batch_size)]

    if args.batch_api:
        serve_tps = batch_api(args, celeris, bodies, env)
        if not args.no_batch:
            batch_tps = compare(celeris, common, bodies, env)
            print(f"Batch API / batch throughput: {serve_tps / batch_tps:.0%}")
        return
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([*celeris, "serve", "--port", str(port), *common], stderr=subprocess.DEVNULL, env=env)
    try:
        wait_ready(url, server)
        post(url + "/v1/completions", {"prompt": "warm up", "max_tokens": 8})
        rss_before = rss_mb(server.pid)[0]
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
        metrics = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
        rows = {k: float(v) for k, v in re.findall(r"^celeris_serve_batch_rows_(sum|count) (\S+)$", metrics, re.M)}
        rss_after, rss_peak = rss_mb(server.pid)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)

    lat = sorted(latencies)
    p99 = lat[min(len(lat) - 1, int(round(0.99 * (len(lat) - 1))))]
    serve_tps = tokens[0] / wall
    load = os.getloadavg()[0]
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}, load average {load:.1f}")
    print(f"model {args.model} ({args.dtype}), {args.requests} requests, max_tokens {args.max_tokens}, ", end="")
    print(f"batch size {args.batch_size}, torch threads {args.threads or 'default'}")
    print(
        f"serve, {args.clients} clients: {len(lat) / wall:.2f} requests/s, {serve_tps:.1f} output tok/s, "
        f"p50 {statistics.median(lat):.2f} s, p99 {p99:.2f} s ({wall:.1f} s)"
    )
    print(f"serve's engine batches: {rows['count']:.0f}, {rows['sum'] / rows['count']:.1f} rows on average")
    print(
        f"serve's RSS: {rss_before:.0f} MiB after warm-up, {rss_after:.0f} MiB after the load (peak {rss_peak:.0f} MiB)"
    )
    if not args.no_batch:
        batch_tps = compare(celeris, common, bodies, env)
        print(f"serve / batch throughput: {serve_tps / batch_tps:.0%}")


def batch_api(args: argparse.Namespace, celeris: list[str], bodies: list[dict], env: dict[str, str]) -> float:
    """One batch of `bodies` through a `celeris serve --queue` and its daemon; prints and returns its output
    tokens/s (create to `completed`)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "configs").mkdir()
        config = root / "configs" / "batch.yaml"
        cfg = {"root": "..", "model": args.model, "device": "cpu", "dtype": args.dtype, "batch_size": args.batch_size}
        config.write_text(json.dumps({**cfg, "threads": args.threads or 1}))  # JSON is YAML
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env}
        server = subprocess.Popen([*celeris, "serve", "--port", str(port), "--queue", str(config)], **quiet)
        daemon = subprocess.Popen([*celeris, "watch", str(config)], **quiet)
        try:
            wait_ready(url, server)
            rss_before = rss_mb(server.pid)[0]
            lines = [
                {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": b}
                for i, b in enumerate(bodies)
            ]
            data = "".join(json.dumps(x) + "\n" for x in lines).encode()
            file_id = upload(url + "/v1/files", data)["id"]
            t0 = time.perf_counter()
            body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
            batch = post(url + "/v1/batches", body)
            polls = 0
            while batch["status"] not in ("completed", "failed", "cancelled"):
                time.sleep(0.5)
                polls += 1
                if polls > 7200:
                    sys.exit("the batch did not finish in an hour")
                batch = json.loads(urllib.request.urlopen(f"{url}/v1/batches/{batch['id']}", timeout=30).read())
            wall = time.perf_counter() - t0
            rss_after, rss_peak = rss_mb(server.pid)
            out = urllib.request.urlopen(f"{url}/v1/files/{batch['output_file_id']}/content", timeout=60).read()
            tokens = sum(json.loads(x)["response"]["body"]["usage"]["completion_tokens"] for x in out.splitlines())
        finally:
            for proc in (server, daemon):
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=120)
    counts = batch["request_counts"]
    print(f"model {args.model} ({args.dtype}), {args.requests} requests, max_tokens {args.max_tokens}, ", end="")
    print(f"batch size {args.batch_size}, torch threads {args.threads or 1}, load average {os.getloadavg()[0]:.1f}")
    print(
        f"Batch API, one batch: {batch['status']} {counts['completed']}/{counts['total']} in {wall:.1f} s, "
        f"{counts['completed'] / wall:.2f} requests/s, {tokens / wall:.1f} output tok/s"
    )
    print(f"serve's RSS: {rss_before:.0f} MiB at start, {rss_after:.0f} MiB after the batch (peak {rss_peak:.0f} MiB)")
    return tokens / wall


def upload(url: str, data: bytes) -> dict:
    boundary = "celerisload"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="load.jsonl"\r\n\r\n'
        ).encode()
        + data
        + f"\r\n--{boundary}--\r\n".encode()
    )
    req = urllib.request.Request(url, data=body, method="POST")
    req.add_header("Content-Type", f"multipart/form-data; boundary={boundary}")
    with urllib.request.urlopen(req, timeout=600) as r:
        return dict(json.loads(r.read()))


def compare(celeris: list[str], common: list[str], bodies: list[dict], env: dict[str, str]) -> float:
    """`celeris batch` on the same requests; prints and returns its output tokens/s."""
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

    print(f"celeris batch, same requests: {batch_tokens / batch_wall:.1f} output tok/s ({batch_wall:.1f} s)")
    return batch_tokens / batch_wall


if __name__ == "__main__":
    main()
