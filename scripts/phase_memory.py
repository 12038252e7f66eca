"""Peak anonymous memory of a moecompress command, per progress phase.

Runs the command, samples ``RssAnon`` of ``/proc/PID/status`` every ``--interval`` seconds (Linux), reads the
command's progress lines (``<time>Z <phase>: <done>/<total> ...``, as printed when stderr is not a terminal) and
prints, for each phase, the largest sample taken while it ran. The figures of "Low-rank compensation: peak
memory" in BENCHMARKS.md come from it.

Run: python scripts/phase_memory.py -- moecompress quantize CKPT --scheme mxfp4 --lowrank-budget 0.25 \\
         --calib-tokens 4096 --no-eval --out OUT
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime

PROGRESS = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)Z (.+?): \d+/\d+ ")


def rss_anon_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    samples: list[tuple[datetime, int]] = []
    with subprocess.Popen(command, stderr=subprocess.PIPE, text=True) as process:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True)
        reader.start()
        while process.poll() is None:
            value = rss_anon_bytes(process.pid)
            if value is not None:
                samples.append((datetime.now(UTC).replace(microsecond=0, tzinfo=None), value))
            time.sleep(args.interval)
        reader.join()
    sys.stderr.writelines(lines[-5:])
    starts: dict[str, datetime] = {}
    for line in lines:
        match = PROGRESS.match(line)
        if match:
            starts.setdefault(match.group(2), datetime.fromisoformat(match.group(1)))
    order = sorted(starts.items(), key=lambda item: item[1])
    peaks: dict[str, int] = {}
    for moment, value in samples:
        phase = "start-up"
        for name, start in order:
            if moment >= start:
                phase = name
        peaks[phase] = max(peaks.get(phase, 0), value)
    for phase, value in peaks.items():
        print(f"{phase:35s} {value / 1e9:6.2f} GB")
    print(f"{'peak':35s} {max(peaks.values(), default=0) / 1e9:6.2f} GB  (exit status {process.returncode})")


if __name__ == "__main__":
    main()
