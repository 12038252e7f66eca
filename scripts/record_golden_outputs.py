"""Record the golden hashes of tests/test_golden_outputs.py: the bytes a fixed list of commands writes on
builtin:tiny-moe, so that a refactor meant to change no output can be checked against them.

Every command runs in this process through Click's CliRunner with one CPU thread, twice, and is recorded only when
both runs hash the same; the killed-and-resumed default recipe must hash as its uninterrupted run. Re-record only
for a change meant to change bytes, and say why in the commit message:

    OMP_NUM_THREADS=1 python scripts/record_golden_outputs.py [WHEN, AT WHICH CODE, WHERE]

Each output file is hashed with SHA-256 of its bytes, except the files in ``NORMALISED_FILES``: those JSON files are
parsed, their run-specific fields normalised, and hashed as ``json.dumps(indent=1)`` of the result, keys kept in the
file's order. Normalised: the keys in ``RUN_SPECIFIC_KEYS`` (the report's ``versions`` of moecompress, torch and
transformers, and its CPU ``threads``) are dropped wherever they appear, and a string holding the package's directory
(in the built-in model's absolute path) or the run's temporary directory gets ``<moecompress>`` or ``<work>`` in
its place.
No output holds a timestamp or a duration at the time of recording; a change that adds one changes the bytes.

Bytes differ with the CPU's vector units and torch's or numba's version, so the file holds one record a platform,
each under its :func:`platform_fingerprint`; the test compares against the record whose fingerprint is this
platform's and skips, saying which parts differ from each, where none is. Recording replaces this platform's record
and keeps the others; to add a platform, record there at the code the other records were made at (a worktree of
that commit with this script), so that every record holds the same code's bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden_outputs.json"
DEFAULT_RECIPE = ROOT / "recipes" / "default.yaml"

MODEL = "builtin:tiny-moe"
CALIB = ["--calib-tokens", "512", "--seq-len", "64"]
QUIET = ["--quiet", "--no-eval"]

COMMANDS: dict[str, list[str]] = {
    "prune-layer": ["prune", MODEL, "--method", "maep", "--ratio", "0.25", "--scope", "layer", *CALIB, *QUIET],
    "prune-global": ["prune", MODEL, "--method", "maep", "--ratio", "0.25", "--scope", "global", *CALIB, *QUIET],
    "quantize-rtn-default-eval": ["quantize", MODEL, "--scheme", "mxfp4", "--quiet"],
    "quantize-gptq": ["quantize", MODEL, "--scheme", "int4", "--method", "gptq", *CALIB, *QUIET],
    "quantize-lowrank": ["quantize", MODEL, "--scheme", "int2", "--lowrank-budget", "0.375", *CALIB, *QUIET],
    "quantize-binary": [
        "quantize", MODEL, "--scheme", "binary", "--salient-fraction", "0.01", "--method", "gptq", *CALIB, *QUIET,
    ],
    "quantize-compressed-tensors": [
        "quantize", MODEL, "--scheme", "int4", "--format", "compressed-tensors", "--targets", "experts,attention",
        *QUIET,
    ],
    "qat": [
        "qat", MODEL, "--scheme", "int2", "--lowrank-budget", "0.375", "--replay", "first:0.5", "--steps", "2",
        "--batch-size", "2", "--train-tokens", "256", *CALIB, *QUIET,
    ],
    "prune-heads": [
        "prune-heads", MODEL, "--ratio", "0.25", "--steps", "2", "--distill-steps", "2", "--batch-size", "2",
        *CALIB, *QUIET,
    ],
}  # fmt: skip
"""Each command's arguments, ``--out DIR`` added when it runs."""

RECIPE = "default-recipe"
RESUMED = "default-recipe-killed-and-resumed"
SHRUNK_RECIPE = {"calibration": {"tokens": 512, "seq_len": 64}, "eval": {"tokens": 256}}
"""recipes/default.yaml with these keys replaced: its calibration and its eval pass's token counts."""
KILL_AT_SHARD = 3
"""The killed run stops when it opens its third output shard: two layers written, the rest to do."""

NORMALISED_FILES = {"moecompress_report.json"}
RUN_SPECIFIC_KEYS = {"versions", "threads"}


def recorded_platforms() -> list[dict]:
    """The records of :data:`GOLDEN`, one a platform: ``fingerprint``, ``outputs`` (case -> file -> SHA-256) and
    ``recorded`` (when, at which code, where)."""
    return json.loads(GOLDEN.read_text())["platforms"] if GOLDEN.is_file() else []


def platform_fingerprint() -> dict[str, str]:
    """What the recorded bytes depend on besides the code: versions, the CPU's vector unit as torch picks it, and
    the hash of a fixed float32 matmul, bf16 matmul, convolution, softmax, exp/log and a long sum, computed with one
    thread as the cases run (the reports' scores and perplexities go through the last four)."""
    import numba
    import numpy
    import torch
    import transformers

    x = torch.sin(torch.arange(96 * 64, dtype=torch.float32) * 0.37).reshape(64, 96)
    w = torch.cos(torch.arange(96 * 80, dtype=torch.float32) * 0.11).reshape(96, 80)
    kernel = torch.cos(torch.arange(8 * 4 * 5, dtype=torch.float32)).reshape(8, 4, 5)
    with one_thread():
        results = [
            x @ w,
            (x.bfloat16() @ w.bfloat16()).float(),
            torch.nn.functional.conv1d(x[:4].unsqueeze(0), kernel),
            torch.softmax(x * 3.1, dim=-1),
            torch.log1p(torch.exp(w)),
            x.sum(dim=0, keepdim=True) + (x * x).mean(),
        ]
    digest = hashlib.sha256(b"".join(r.contiguous().numpy().tobytes() for r in results)).hexdigest()
    return {
        "torch": torch.__version__,
        "numba": numba.__version__,
        "numpy": numpy.__version__,
        "transformers": transformers.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "arithmetic": digest,
    }


def _normalise(value: object, roots: dict[str, str]) -> object:
    if isinstance(value, dict):
        return {k: _normalise(v, roots) for k, v in value.items() if k not in RUN_SPECIFIC_KEYS}
    if isinstance(value, list):
        return [_normalise(v, roots) for v in value]
    if isinstance(value, str):
        for root, name in roots.items():
            value = value.replace(root, name)
    return value


def output_hashes(directory: Path, work: Path) -> dict[str, str]:
    """SHA-256 of every file under ``directory`` by its relative path, the ``NORMALISED_FILES`` normalised."""
    import moecompress

    roots = {str(work): "<work>", str(Path(moecompress.__file__).parent): "<moecompress>"}
    hashes = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.name in NORMALISED_FILES:
            data = json.dumps(_normalise(json.loads(data), roots), indent=1).encode()
        hashes[path.relative_to(directory).as_posix()] = hashlib.sha256(data).hexdigest()
    return hashes


@contextmanager
def one_thread() -> Iterator[None]:
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _invoke(argv: list[str]):
    from click.testing import CliRunner

    from moecompress import progress
    from moecompress.cli.main import app

    try:
        return CliRunner().invoke(app, argv)
    finally:
        progress.configure()


def run_command(name: str, work: Path) -> dict[str, str]:
    """Run ``COMMANDS[name]`` into ``work/out``; its output's hashes."""
    out = work / "out"
    result = _invoke([*COMMANDS[name], "--out", str(out)])
    if result.exit_code != 0:
        raise RuntimeError(f"{name} failed ({result.exit_code}): {result.output}") from result.exception
    return output_hashes(out, work)


def shrunk_recipe(work: Path) -> Path:
    """recipes/default.yaml with ``SHRUNK_RECIPE``'s keys replaced, written into ``work``."""
    recipe = yaml.safe_load(DEFAULT_RECIPE.read_text())
    recipe["calibration"].update(SHRUNK_RECIPE["calibration"])
    (evaluation,) = [step["eval"] for step in recipe["passes"] if "eval" in step]
    evaluation.update(SHRUNK_RECIPE["eval"])
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def run_recipe(work: Path, *extra: str):
    return _invoke(["run", str(shrunk_recipe(work)), "--out", str(work / "out"), "--quiet", *extra])


def run_default_recipe(work: Path) -> dict[str, str]:
    result = run_recipe(work)
    if result.exit_code != 0:
        raise RuntimeError(f"{RECIPE} failed ({result.exit_code}): {result.output}") from result.exception
    return output_hashes(work / "out", work)


class InjectedKill(BaseException):
    """Stands for a kill: a BaseException, so the run's handlers let it pass and its partial work stays."""


def run_killed_and_resumed(work: Path) -> dict[str, str]:
    """The shrunk default recipe stopped when it opens output shard ``KILL_AT_SHARD``, then ``--resume``d."""
    from moecompress import files

    real, shards = files.write_chunk, []

    def write_chunk(handle, data):
        if Path(handle.name).name.startswith("shard-") and not any(handle is seen for seen in shards):
            shards.append(handle)
            if len(shards) == KILL_AT_SHARD:
                raise InjectedKill
        real(handle, data)

    files.write_chunk = write_chunk
    try:
        killed = run_recipe(work)
    except InjectedKill:
        killed = None
    finally:
        files.write_chunk = real
    if killed is not None:
        raise RuntimeError(f"the run was not stopped at shard {KILL_AT_SHARD}: {killed.output}") from killed.exception
    journal = work / ".out.run" / ".step-0.incomplete" / "journal.jsonl"
    units = len(journal.read_text().splitlines()) - 1 if journal.is_file() else 0
    if (work / "out").exists() or units != KILL_AT_SHARD - 1:
        raise RuntimeError(f"the killed run left {units} layers written, not {KILL_AT_SHARD - 1}")
    resumed = run_recipe(work, "--resume")
    if resumed.exit_code != 0:
        raise RuntimeError(f"--resume failed ({resumed.exit_code}): {resumed.output}") from resumed.exception
    return output_hashes(work / "out", work)


def run_case(name: str) -> dict[str, str]:
    """Run one case of the golden list in a fresh temporary directory with one thread; its output's hashes."""
    runner = {RECIPE: run_default_recipe, RESUMED: run_killed_and_resumed}.get(name)
    with one_thread(), tempfile.TemporaryDirectory(prefix="golden-") as work:
        if runner is not None:
            return runner(Path(work))
        return run_command(name, Path(work))


CASES = [*COMMANDS, RECIPE, RESUMED]
RECORDED_AS = {RESUMED: RECIPE}
"""The resumed run is held to the uninterrupted run's hashes; it is not recorded on its own."""


def main() -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    golden = {"fingerprint": platform_fingerprint(), "outputs": {}}
    if len(sys.argv) > 1:
        golden = {"recorded": " ".join(sys.argv[1:]), **golden}
    for name in CASES:
        start = time.perf_counter()
        first, second = run_case(name), run_case(name)
        if first != second:
            differing = sorted(k for k in first.keys() | second.keys() if first.get(k) != second.get(k))
            print(f"{name}: two runs differ in {differing}; nothing recorded", file=sys.stderr)
            return 1
        recorded_as = RECORDED_AS.get(name, name)
        if recorded_as != name and first != golden["outputs"][recorded_as]:
            print(f"{name} differs from {recorded_as}; nothing recorded", file=sys.stderr)
            return 1
        golden["outputs"][recorded_as] = first
        print(f"{name}: {len(first)} files, two runs equal ({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    others = [p for p in recorded_platforms() if p["fingerprint"] != golden["fingerprint"]]
    GOLDEN.write_text(json.dumps({"platforms": [*others, golden]}, indent=1) + "\n")
    print(f"wrote {GOLDEN}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
