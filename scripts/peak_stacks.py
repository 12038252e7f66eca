"""Where a moecompress command's memory peaks: runs the command in this process, samples its RSS every
``--interval`` seconds and, at each new high (in steps of ``--step`` MB above ``--above`` GB), prints the main
thread's innermost moecompress / transformers / torch frames to stderr. The last block printed is the peak.

The "one layer, default recipe" figures at a real vocabulary in BENCHMARKS.md come from it.

Run: python scripts/peak_stacks.py -- run RECIPE --model CKPT --out OUT -q 2> stacks.txt
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import traceback

import psutil


def watch(interval: float, above: float, step: float) -> None:
    process, main = psutil.Process(), threading.main_thread()
    highest = 0
    while True:
        rss = process.memory_info().rss
        if rss > highest + step and rss > above:
            highest = rss
            frame = sys._current_frames().get(main.ident)
            print(f"--- {rss / 1e9:.2f} GB", file=sys.stderr)
            for entry in traceback.extract_stack(frame)[-9:]:
                if any(part in entry.filename for part in ("moecompress", "transformers", "torch")):
                    where = entry.filename.split("site-packages/")[-1]
                    print(f"   {where}:{entry.lineno} {entry.name}: {entry.line}", file=sys.stderr)
            sys.stderr.flush()
        time.sleep(interval)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=0.05, help="Seconds between samples.")
    parser.add_argument("--above", type=float, default=2.0, help="Report only above this many GB.")
    parser.add_argument("--step", type=float, default=150.0, help="MB above the last report for a new one.")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the moecompress arguments")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    threading.Thread(target=watch, args=(args.interval, args.above * 1e9, args.step * 1e6), daemon=True).start()
    sys.argv = ["moecompress", *command]
    from moecompress.cli.main import main as moecompress_main

    moecompress_main()


if __name__ == "__main__":
    main()
