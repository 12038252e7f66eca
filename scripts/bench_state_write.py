"""A sweep state written by the checked writer (``files.write_safetensors``: streamed, tensor by tensor) against
safetensors' ``save_file`` to a temporary name and a rename (what ``sweep_state`` did before), alternating, with the
median of each and their ratio. Both files are checked to hold the same tensors.

Run: OMP_NUM_THREADS=1 python scripts/bench_state_write.py --dir /tmp/state-bench --mib 256 --repeats 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moecompress.files import write_safetensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--mib", type=int, default=256, help="size of the state (bf16 batches of 16 MiB)")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    state = {f"batch-{i}": torch.randn(8, 512, 2048).to(torch.bfloat16) for i in range(args.mib // 16)}
    metadata = {"after_layer": "3", "result_layers": "[0, 1, 2, 3]"}

    def before(path: Path) -> None:
        temporary = path.with_name(path.name + ".tmp")
        save_file(state, str(temporary), metadata=metadata)
        os.replace(temporary, path)

    def checked(path: Path) -> None:
        write_safetensors(path, state, metadata)

    times: dict[str, list[float]] = {"save_file": [], "checked writer": []}
    writers = [("save_file", before), ("checked writer", checked)]
    for repeat in range(args.repeats):
        for name, write in writers if repeat % 2 == 0 else writers[::-1]:
            started = time.perf_counter()
            write(args.dir / f"{name.replace(' ', '-')}.safetensors")
            times[name].append(time.perf_counter() - started)
    old, new = (load_file(args.dir / f"{name.replace(' ', '-')}.safetensors") for name, _ in writers)
    assert old.keys() == new.keys() and all(torch.equal(old[key], new[key]) for key in old)
    for name, values in times.items():
        print(f"{name:15s} median {statistics.median(values):.3f} s  ({' '.join(f'{v:.2f}' for v in values)})")
    ratio = statistics.median(times["checked writer"]) / statistics.median(times["save_file"])
    print(f"checked writer / save_file: {ratio:.2f}")
    for name, _ in writers:
        (args.dir / f"{name.replace(' ', '-')}.safetensors").unlink()


if __name__ == "__main__":
    main()
