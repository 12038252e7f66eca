"""Perplexity in llama.cpp against moecompress on the same token windows, for docs/llama_cpp.md.

For each ``LABEL=MODEL_DIR`` it exports ``MODEL_DIR`` to GGUF (``moecompress export --format gguf``), then:

- checks that llama.cpp tokenises the data file (``llama-tokenize``, with the BOS it adds if any) to the tokens the
  transformers tokenizer gives;
- runs ``llama-perplexity -c 129 -b 129 --ppl-stride 255``: llama.cpp pads the context to 256, so it scores
  windows ``[255 i, 255 i + 256)`` (consecutive windows share one token), each token after a window's first;
- scores exactly those windows with moecompress's own evaluation (``evaluate_windows``, the function behind
  ``moecompress eval``) on the model loaded as ``moecompress eval`` loads it;
- runs ``moecompress eval --seq-len 256`` on the same file, all of it (its own non-overlapping windows
  ``[256 i, 256 i + 256)`` of its own token stream: the text plus ``"\n\n"``, no BOS).

Prints a markdown table and writes JSON. Usage::

    python scripts/llama_cpp_table.py --bin LLAMA_BUILD/bin --llama-cpp SDIST --data FILE.txt --work DIR \\
        --json-out table.json original=builtin:tiny-moe mxfp4=DIR ...
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import torch

CTX, STRIDE, WINDOW = 129, 255, 256


def run(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(command)}\n{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def llama_tokens(binary: Path, gguf: Path, data: Path) -> list[int]:
    out = subprocess.run(
        [str(binary / "llama-tokenize"), "-m", str(gguf), "-f", str(data), "--ids", "--log-disable"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def llama_perplexity(binary: Path, gguf: Path, data: Path) -> tuple[float, int, str]:
    command = [str(binary / "llama-perplexity"), "-m", str(gguf), "-f", str(data)]
    command += ["-c", str(CTX), "-b", str(CTX), "--ppl-stride", str(STRIDE), "-t", "1"]
    text = run(command)
    chunks = re.findall(r"\[(\d+)\]([0-9.]+),", text)
    if not chunks:
        sys.exit(f"no perplexity in llama-perplexity's output:\n{text[-2000:]}")
    n_ctx = re.search(r"n_ctx\s*=\s*(\d+)", text)
    if n_ctx is None or int(n_ctx.group(1)) != WINDOW:
        sys.exit(f"llama.cpp's context is not {WINDOW} tokens:\n{text[-2000:]}")
    return float(chunks[-1][1]), int(chunks[-1][0]), " ".join(command)


def moecompress_same_windows(model_dir: Path, tokens: list[int], chunks: int) -> float:
    from moecompress.calibration.batches import TokenWindows
    from moecompress.evals.perplexity import evaluate_windows
    from moecompress.loading import load_adapter, load_model

    ids = torch.tensor(tokens, dtype=torch.long)
    windows = torch.stack([ids[i * STRIDE : i * STRIDE + WINDOW] for i in range(chunks)])
    adapter = load_adapter(model_dir)
    model = load_model(model_dir, adapter)
    result = evaluate_windows(
        model, adapter, TokenWindows(windows, torch.zeros_like(windows), ["text"]), progress=False
    )
    return float(result.perplexity)


def moecompress_eval(model_dir: Path, data: Path, work: Path) -> tuple[float, str]:
    out = work / f"{model_dir.name}.eval.json"
    command = ["moecompress", "eval", str(model_dir), "--data", str(data), "--seq-len", str(WINDOW)]
    command += ["--max-tokens", "100000000"]
    command += ["--json-out", str(out)]
    run(command)
    return float(json.loads(out.read_text())["perplexity"]), " ".join(command)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bin", type=Path, required=True, help="directory with llama-perplexity, llama-tokenize")
    parser.add_argument("--llama-cpp", required=True, help="the converter's directory (llama.cpp or the sdist)")
    parser.add_argument("--data", type=Path, required=True, help="a .txt file (one document)")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--json-out", type=Path, required=True)
    parser.add_argument("models", nargs="+", help="LABEL=MODEL (a directory or builtin:tiny-moe)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from moecompress.checkpoint import resolve_model

    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in args.models:
        label, model = spec.split("=", 1)
        model_dir = resolve_model(model)
        gguf = args.work / f"{label}.gguf"
        export = ["moecompress", "export", model, "--format", "gguf", "--out", str(gguf), "--overwrite"]
        export += ["--llama-cpp", args.llama_cpp, "--quiet"]
        run(export)
        report = json.loads(gguf.with_name(gguf.name + ".report.json").read_text())
        tokens = llama_tokens(args.bin, gguf, args.data)
        ours = AutoTokenizer.from_pretrained(model_dir)(args.data.read_text(), add_special_tokens=False)["input_ids"]
        bos = tokens[: len(tokens) - len(ours)]
        same_tokens = tokens[len(bos) :] == ours and len(bos) <= 1
        ppl_llama, chunks, llama_command = llama_perplexity(args.bin, gguf, args.data)
        ppl_same = moecompress_same_windows(model_dir, tokens, chunks)
        ppl_eval, eval_command = moecompress_eval(model_dir, args.data, args.work)
        experts = report["experts"]["written_as"]
        rows.append(
            {
                "label": label,
                "model": model,
                "gguf_bytes": gguf.stat().st_size,
                "checkpoint_bytes": sum(p.stat().st_size for p in model_dir.glob("*.safetensors")),
                "experts_in_gguf": experts if isinstance(experts, list) else "bf16 (converter)",
                "experts_exact": report["experts"].get("all_exact"),
                "tokens": len(tokens),
                "bos_added": bool(bos),
                "tokenisation_matches": same_tokens,
                "windows": chunks,
                "llama_cpp_ppl": ppl_llama,
                "moecompress_same_windows_ppl": ppl_same,
                "relative_difference": abs(ppl_llama - ppl_same) / ppl_same,
                "moecompress_eval_ppl": ppl_eval,
                "commands": {"export": " ".join(export), "llama": llama_command, "eval": eval_command},
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    args.json_out.write_text(json.dumps(rows, indent=2) + "\n")
    print(
        "| output | GGUF bytes | experts in GGUF | llama.cpp ppl | moecompress ppl, same windows | difference "
        "| `moecompress eval` ppl (own windows) |"
    )
    print("|---|---:|---|---:|---:|---:|---:|")
    for row in rows:
        kinds = row["experts_in_gguf"]
        kinds = ", ".join(kinds) if isinstance(kinds, list) else kinds
        print(
            f"| {row['label']} | {row['gguf_bytes']:,} | {kinds} | {row['llama_cpp_ppl']:.4f} "
            f"| {row['moecompress_same_windows_ppl']:.4f} | {100 * row['relative_difference']:.3f}% "
            f"| {row['moecompress_eval_ppl']:.4f} |"
        )


if __name__ == "__main__":
    main()
