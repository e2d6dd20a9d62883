"""How long `celeris --help` and `celeris generate --help` take, as a user sees it: a fresh process each
time, through the installed `celeris` entry point. Prints min and median of N runs (default 5), wall and CPU
(user + system: on a loaded machine the wall time counts other jobs' turns).

    python scripts/help_time.py [N]
"""

from __future__ import annotations

import resource
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
        times, cpu = [], []
        for _ in range(runs):
            t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run([*base, *args], check=True, capture_output=True)
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            times.append((time.perf_counter() - t0) * 1000)
            cpu.append((r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) * 1000)
        print(
            f"celeris {' '.join(args)}: min {min(times):.0f} ms, median {statistics.median(times):.0f} ms; CPU min "
            f"{min(cpu):.0f} ms, median {statistics.median(cpu):.0f} ms ({runs} runs)"
        )


if __name__ == "__main__":
    main()
