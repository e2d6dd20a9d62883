"""How long `celeris --help` and `celeris generate --help` take, as a user sees it: a fresh process each
time, through the installed `celeris` entry point. Prints min and median of N runs (default 5).

    python scripts/help_time.py [N]
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import time


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    exe = shutil.which("celeris")
    base = [exe] if exe else [sys.executable, "-m", "celeris_cli"]
    for args in (["--help"], ["generate", "--help"]):
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            subprocess.run([*base, *args], check=True, capture_output=True)
            times.append((time.perf_counter() - t0) * 1000)
        median = statistics.median(times)
        print(f"celeris {' '.join(args)}: min {min(times):.0f} ms, median {median:.0f} ms ({runs} runs)")


if __name__ == "__main__":
    main()
