"""llama-quantize with moecompress's importance matrix (``quantize --imatrix-out``) against llama-imatrix's own, on
the same calibration text, for docs/llama_cpp.md.

1. ``moecompress export MODEL --format gguf`` (the converter's bf16 GGUF);
2. ``moecompress quantize MODEL --imatrix-out ours.imatrix`` with ``--calib-tokens N --seq-len 256`` (RTN MXFP4:
   the importance matrix is the same whatever the scheme), and the calibration windows it drew, decoded, joined
   into ``calib.txt``;
3. ``llama-imatrix -m bf16.gguf -f calib.txt -c 256 --process-output`` (its chunks are 256 tokens of the same
   text; ``--process-output`` collects ``output.weight`` too, as ours does for an untied head);
4. two controls: ours with ``--seed 1`` (other calibration windows of the same source), and ours computed on
   llama-imatrix's own chunks (``calib.txt`` tokenized whole and cut into consecutive chunks: the joined windows do
   not tokenize back into the same windows, so from the first window that does not, llama-imatrix's chunks are
   shifted against ours); the latter through ``quantize_checkpoint`` with its window sampler replaced by those
   chunks. The per-channel agreement of each file with llama-imatrix's is printed;
5. for each type, ``llama-quantize`` without an importance matrix, with each file, and with ours and
   llama-imatrix's restricted to the routed experts and router (``--exclude-weights attn_``); then ``llama-perplexity
   -c 256 --no-repack`` on the held-out text: the running perplexity after its first 64 chunks of 256 tokens (each
   chunk's second half scored); with the CPU backend's weight repacking, this llama-perplexity crashes (signal 11)
   loading the Q2_K file.

The bf16 GGUF and the importance matrices are kept in ``--work`` and reused by a rerun. Prints a markdown table
and writes JSON. Usage::

    python scripts/imatrix_compare.py --bin LLAMA_BUILD/bin --work DIR --json-out imatrix.json
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = "builtin:tiny-moe"
CTX = 256
TYPES = ("Q2_K", "Q4_K_M")


def run(command: list[str]) -> str:
    """The command's output; into a file, since llama.cpp's tools lose their last lines (the final perplexity)
    when their output is a pipe."""
    with tempfile.TemporaryFile("w+") as log:
        done = subprocess.run([str(part) for part in command], stdout=log, stderr=subprocess.STDOUT, text=True)
        log.seek(0)
        text = log.read()
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(map(str, command))}\n{text[-3000:]}")
    return text


def calibration_text(path: Path, tokens: int, model_name: str = MODEL) -> int:
    """The windows ``quantize model_name --calib-tokens tokens --seq-len CTX`` draws (seed 0), decoded and joined."""
    from moecompress.calibration.model_inputs import calibration_batches
    from moecompress.checkpoint import resolve_model
    from moecompress.loading import load_adapter, load_tokenizer

    model = resolve_model(model_name)
    batches, _, _ = calibration_batches(load_adapter(model), model, "builtin:prose", tokens, CTX, 8, 0, 224)
    tokenizer = load_tokenizer(model)
    windows = [row.tolist() for batch in batches for row in batch["input_ids"]]
    path.write_text("".join(tokenizer.decode(window) for window in windows))
    return len(windows)


def ours_on_chunks(work: Path, target: Path, windows: int) -> None:
    """Our importance matrix from llama-imatrix's chunks of ``calib.txt`` (the first ``windows`` of CTX tokens)."""
    import torch

    import moecompress.passes.prune_experts as sampling
    import moecompress.passes.quantize as quantize
    from moecompress.checkpoint import resolve_model
    from moecompress.loading import load_tokenizer

    model = resolve_model(MODEL)
    ids = load_tokenizer(model)((work / "calib.txt").read_text(), add_special_tokens=False)["input_ids"]
    chunks = torch.tensor(ids[: windows * CTX]).reshape(windows, CTX)

    def llama_imatrix_chunks(adapter, model_dir, calib, tokens, seq_len, batch_size, seed, image_size):
        batches = [{"input_ids": chunks[start : start + batch_size]} for start in range(0, windows, batch_size)]
        return batches, torch.zeros(chunks.numel(), dtype=torch.long), ["calib.txt"]

    sampler, sampling.calibration_batches = sampling.calibration_batches, llama_imatrix_chunks
    try:
        config = quantize.QuantizeConfig(scheme="mxfp4", imatrix_out=str(target))
        quantize.quantize_checkpoint(
            model, work / "q-chunks", config, calib_tokens=chunks.numel(), seq_len=CTX, overwrite=True, progress=False
        )
    finally:
        sampling.calibration_batches = sampler


def agreement(ours: Path, theirs: Path) -> dict[str, float]:
    """Over the tensors both files hold: the median and largest relative difference of a channel's mean square
    (sum / count; experts with tokens in both), and the largest difference of a token count."""
    import gguf
    import numpy as np

    def read(path: Path) -> dict:
        return {t.name: np.array(t.data, dtype=np.float64) for t in gguf.GGUFReader(path).tensors}

    a, b = read(ours), read(theirs)
    relative, counts = [], 0.0
    for key in sorted(k for k in a if k.endswith(".in_sum2") and k in b):
        name = key.removesuffix(".in_sum2")
        ca, cb = a[f"{name}.counts"].reshape(-1, 1), b[f"{name}.counts"].reshape(-1, 1)
        counts = max(counts, float(np.abs(ca - cb).max()))
        seen = ((ca > 0) & (cb > 0)).ravel()
        ma = (a[key].reshape(len(ca), -1) / np.maximum(ca, 1))[seen]
        mb = (b[key].reshape(len(cb), -1) / np.maximum(cb, 1))[seen]
        relative.append(np.abs(ma / mb - 1).ravel())
    every = np.concatenate(relative)
    return {"median_channel": float(np.median(every)), "max_channel": float(every.max()), "max_count": counts}


def heldout_text(path: Path) -> None:
    from moecompress.calibration.builtin_corpus import builtin_documents

    path.write_text("\n\n".join(d.text for d in builtin_documents("prose", "heldout")))


def perplexity(binary: Path, gguf: Path, data: Path, threads: int, chunks: int) -> float:
    """Perplexity over the first ``chunks`` chunks: the running value llama-perplexity prints after chunk
    ``chunks`` of a run one chunk longer. Its log is written by a thread that the process does not wait for at
    exit, so the last lines (the last chunk's value, "Final estimate") are lost in about half the runs here."""
    command = [binary / "llama-perplexity", "-m", gguf, "-f", data, "-c", CTX, "-b", CTX, "-t", threads]
    text = run([*command, "--chunks", chunks + 1, "--no-repack"])  # this build's CPU repacking crashes on Q2_K
    values = dict(re.findall(r"\[(\d+)\]([0-9.]+),", text))
    if str(chunks) not in values:
        sys.exit(f"no perplexity after chunk {chunks} in llama-perplexity's output:\n{text[-2000:]}")
    return float(values[str(chunks)])


def fallbacks(log: str) -> dict[str, int]:
    """How many tensors llama-quantize gave a fallback type because their width is not a multiple of 256."""
    counts: dict[str, int] = {}
    for kind in re.findall(r"-> falling back to\s+(\w+)", log):
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bin", type=Path, required=True, help="directory of llama-imatrix, -quantize, -perplexity")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--calib-tokens", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=64, help="held-out chunks of 256 tokens llama-perplexity scores")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    work, binary = args.work.absolute(), args.bin.absolute()
    work.mkdir(parents=True, exist_ok=True)
    base = work / "bf16.gguf"
    if not base.exists():
        run(["moecompress", "export", MODEL, "--format", "gguf", "--out", base])
    calib, heldout = work / "calib.txt", work / "heldout.txt"
    chunks = calibration_text(calib, args.calib_tokens)
    heldout_text(heldout)
    ours, theirs = work / "ours.imatrix", work / "theirs.imatrix"
    command = ["moecompress", "quantize", MODEL, "--out", work / "q", "--overwrite", "--scheme", "mxfp4"]
    command += ["--imatrix-out", ours, "--calib-tokens", args.calib_tokens, "--seq-len", CTX, "--no-eval", "--quiet"]
    if not ours.exists():
        run(command)
    imatrix_command = [binary / "llama-imatrix", "-m", base, "-f", calib, "-o", theirs, "-c", CTX]
    imatrix_command += ["-t", args.threads, "--no-ppl", "--process-output"]
    if not theirs.exists():
        run(imatrix_command)
    seed1, chunked = work / "ours-seed1.imatrix", work / "ours-chunks.imatrix"
    if not seed1.exists():
        run([*[part if part != ours else seed1 for part in command], "--seed", 1])
    if not chunked.exists():
        ours_on_chunks(work, chunked, chunks)
    agreements = {name: agreement(path, theirs) for name, path in (("ours", ours), ("on its chunks", chunked))}
    sources = {
        "none": ("none", []),
        "moecompress": ("ours", ["--imatrix", ours]),
        "moecompress, --seed 1": ("ours-seed1", ["--imatrix", seed1]),
        "moecompress on llama-imatrix's chunks": ("ours-chunks", ["--imatrix", chunked]),
        "moecompress, experts and router only": ("ours-moe", ["--imatrix", ours, "--exclude-weights", "attn_"]),
        "llama-imatrix": ("theirs", ["--imatrix", theirs]),
        "llama-imatrix, experts and router only": ("theirs-moe", ["--imatrix", theirs, "--exclude-weights", "attn_"]),
    }
    rows = [{"type": "BF16", "imatrix": "—", "bytes": base.stat().st_size, "ppl": None}]
    rows[0]["ppl"] = perplexity(binary, base, heldout, args.threads, args.chunks)
    for kind in TYPES:
        for label, (name, options) in sources.items():
            out = work / f"{kind}-{name}.gguf"
            log = run([binary / "llama-quantize", *options, base, out, kind, args.threads])
            entries = re.search(r"have (\d+) importance matrix entries", log)  # after --exclude-weights
            rows.append(
                {
                    "type": kind,
                    "imatrix": label,
                    "entries": int(entries.group(1)) if entries else 0,
                    "bytes": out.stat().st_size,
                    "ppl": perplexity(binary, out, heldout, args.threads, args.chunks),
                    "fallbacks": fallbacks(log),
                    "command": " ".join(map(str, [binary / "llama-quantize", *options, base, out, kind])),
                }
            )
    print("| type | importance matrix | entries | GGUF bytes | llama-perplexity |")
    print("|---|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row['type']} | {row['imatrix']} | {row.get('entries', '—')} | {row['bytes']:,} | {row['ppl']:.4f} |")
    for row in rows[1:]:
        if row["imatrix"] == "none":
            print(f"{row['type']}: fallback types (widths not a multiple of 256): {row['fallbacks']}")
    for name, values in agreements.items():
        print(f"moecompress ({name}) against llama-imatrix: {values}")
    if args.json_out:
        meta = {"calibration_windows": chunks, "calib_tokens": args.calib_tokens, "ctx": CTX, "chunks": args.chunks}
        meta["imatrix_command"] = " ".join(map(str, imatrix_command))
        meta["quantize_command"] = " ".join(map(str, command))
        meta["agreement_with_llama_imatrix"] = agreements
        args.json_out.write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
