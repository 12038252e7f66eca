"""Run every bad-input case of every command and write the table of their messages (docs/bad_input.md).

Each case is a command line that must be refused with exit code 2 and exactly one line on stderr, before any work
and without writing anything; the table records the line. tests/test_bad_input.py runs the same cases, so the
table and the tests cannot drift apart. The cases run in this one process (the entry point's ``main`` with
``sys.argv`` set), so all of them take seconds, not one interpreter start each.

    python scripts/bad_input_table.py                      # check every case, print the table
    python scripts/bad_input_table.py --markdown docs/bad_input.md
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Case:
    id: str
    args: tuple[str, ...]
    """The command line after ``moecompress``; ``{w}`` is the case's own empty directory, ``{s}`` the shared one."""
    expect: str
    """A fragment the one stderr line must hold."""
    setup: str | None = None
    """The name of a function in :data:`SETUPS` that prepares ``{w}`` first."""

    def argv(self, work: Path, shared: Path) -> list[str]:
        return [arg.format(w=work, s=shared) for arg in self.args]


TINY = "builtin:tiny-moe"
DEFAULT_RECIPE = str(ROOT / "recipes" / "default.yaml")
OUT = "{w}/out"


def _recipe(body: str) -> Callable[[Path], None]:
    def write(work: Path) -> None:
        (work / "recipe.yaml").write_text(body)

    return write


SETUPS: dict[str, Callable[[Path], None]] = {
    "partial_run": lambda w: (w / ".out.run").mkdir(),
    "partial_writer": lambda w: (w / ".out.incomplete").mkdir(),
    "out_exists": lambda w: (w / "out").mkdir(),
    "a_file": lambda w: (w / "afile").write_text("not a directory\n"),
    "empty_dir": lambda w: (w / "empty").mkdir(),
    "bad_json": lambda w: ((w / "m").mkdir(), (w / "m" / "config.json").write_text("{not json")),
    "bad_yaml": _recipe("model: [unclosed\n"),
    "unknown_key": _recipe("model: builtin:tiny-moe\nmodle: x\npasses:\n  - quantize: {}\n"),
    "lowrank_first": _recipe("model: builtin:tiny-moe\npasses:\n  - lowrank: {lowrank_budget: 0.25}\n"),
    "prune_after_quantize": _recipe(
        "model: builtin:tiny-moe\npasses:\n  - quantize: {}\n  - prune_experts: {ratio: 0.25}\n"
    ),
    "keep_9": _recipe("model: builtin:tiny-moe\npasses:\n  - prune_experts: {keep: 9, ratio: null}\n"),
    "short_calibration": _recipe(
        "model: builtin:tiny-moe\ncalibration: {tokens: 100}\npasses:\n  - quantize: {method: gptq}\n"
    ),
    "no_model": _recipe("passes:\n  - quantize: {}\n"),
    "bad_scheme": _recipe("model: builtin:tiny-moe\npasses:\n  - quantize: {scheme: int3}\n"),
    "project_dir": lambda w: ((w / "proj").mkdir(), (w / "proj" / "notes.txt").write_text("not moecompress's\n")),
    "locked": lambda w: _held_by_another_run(w),
    "locked_partial": lambda w: ((w / ".out.run").mkdir(), _held_by_another_run(w)),
    "inputs_in_output": lambda w: (
        (w / "out").mkdir(),
        (w / "out" / "moecompress_report.json").write_text("{}\n"),
        (w / "out" / "recipe.yaml").write_text("model: builtin:tiny-moe\npasses:\n  - quantize: {}\n"),
        (w / "out" / "notes.txt").write_text("calibration text\n" * 2000),
    ),
}

_HELD: list[int] = []
"""Descriptors of the locks the "locked" setups hold for the rest of this process."""


def _held_by_another_run(work: Path) -> None:
    """``{w}/out`` locked as a run still writing it holds it (pid 4242 written as the holder): flock on a
    descriptor of its own, which the case's run cannot take even in this process."""
    import fcntl

    descriptor = os.open(work / ".out.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(descriptor, b"4242\nmoecompress quantize builtin:tiny-moe --out out\n")
    _HELD.append(descriptor)


# issue 40: consistency on read
def _tiny_copy(
    config: Callable[[dict], object] | None = None, header: Callable[[dict, bytes], bytes] | None = None
) -> Callable[[Path], None]:
    """A setup that copies tiny-moe to ``{w}/m`` and edits its config.json (in place) or its safetensors header
    (``header`` edits the header in place and returns the data section to write)."""

    def setup(work: Path) -> None:
        import struct

        from moecompress.checkpoint import resolve_model

        model = work / "m"
        shutil.copytree(resolve_model(TINY), model)
        if config is not None:
            values = json.loads((model / "config.json").read_text())
            config(values)
            (model / "config.json").write_text(json.dumps(values, indent=2))
        if header is not None:
            shard = model / "model.safetensors"
            raw = shard.read_bytes()
            (length,) = struct.unpack("<Q", raw[:8])
            values = json.loads(raw[8 : 8 + length])
            data = header(values, raw[8 + length :])
            text = json.dumps(values).encode()
            text += b" " * (-len(text) % 8)
            shard.write_bytes(struct.pack("<Q", len(text)) + text + data)

    return setup


def _entry(name: str, **fields: object) -> Callable[[dict, bytes], bytes]:
    def edit(values: dict, data: bytes) -> bytes:
        values[name].update(fields)
        return data

    return edit


def _nan_weight(values: dict, data: bytes) -> bytes:
    """A NaN (bf16 0x7fc0) as the first value of layer 0's query projection."""
    begin = values["model.layers.0.self_attn.q_proj.weight"]["data_offsets"][0]
    return data[:begin] + b"\xc0\x7f" + data[begin + 2 :]


def _then(*setups: Callable[[Path], None]) -> Callable[[Path], None]:
    return lambda work: [setup(work) for setup in setups]


def _weights_directory(work: Path) -> None:
    (work / "m" / "model.safetensors").unlink()
    (work / "m" / "model.safetensors").mkdir()


def _index_naming(shard: str, make_directory: bool = False) -> Callable[[Path], None]:
    """An index whose weight map puts one tensor in ``shard`` (made a directory with ``make_directory``)."""

    def setup(work: Path) -> None:
        weight_map = {"model.embed_tokens.weight": shard, "model.norm.weight": "model.safetensors"}
        (work / "m" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        if make_directory:
            (work / "m" / shard).mkdir()

    return setup


def _no_tokenizer(work: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (work / "m" / name).unlink()


def _recipe_bytes(data: bytes) -> Callable[[Path], None]:
    return lambda work: (work / "recipe.yaml").write_bytes(data)


def _model_recipe(work: Path) -> None:
    (work / "recipe.yaml").write_text(f"model: {work / 'm'}\npasses:\n  - quantize: {{}}\n")


SETUPS.update(
    {
        "cfg_hidden": _tiny_copy(lambda c: c.update(hidden_size=256)),
        "cfg_more_layers": _tiny_copy(lambda c: c.update(num_hidden_layers=6)),
        "cfg_fewer_layers": _tiny_copy(lambda c: c.update(num_hidden_layers=3)),
        "cfg_vocab": _tiny_copy(lambda c: c.update(vocab_size=4096)),
        "cfg_experts": _tiny_copy(lambda c: c.update(num_experts=16)),
        "cfg_expert_width": _tiny_copy(lambda c: c.update(moe_intermediate_size=512)),
        "cfg_size_string": _tiny_copy(lambda c: c.update(hidden_size="128")),
        "cfg_array": _then(_tiny_copy(), lambda w: (w / "m" / "config.json").write_text("[1, 2]\n")),
        "cfg_text_config_list": _tiny_copy(lambda c: c.update(text_config=[])),
        "cfg_layers_recipe": _then(_tiny_copy(lambda c: c.update(num_hidden_layers=6)), _model_recipe),
        "weights_directory": _then(_tiny_copy(), _weights_directory),
        "index_shard_directory": _then(_tiny_copy(), _index_naming("model-00002.safetensors", True)),
        "index_shard_missing": _then(_tiny_copy(), _index_naming("model-00002.safetensors")),
        "index_shard_outside": _then(_tiny_copy(), _index_naming("../elsewhere.safetensors")),
        "st_overlap": _tiny_copy(header=_entry("model.layers.0.input_layernorm.weight", data_offsets=[0, 256])),
        "st_shape_size": _tiny_copy(header=_entry("model.layers.0.input_layernorm.weight", shape=[64])),
        "st_bad_shape": _tiny_copy(header=_entry("model.norm.weight", shape=["128"])),
        "st_trailing": _tiny_copy(header=lambda values, data: data + bytes(64)),
        "nan_weight": _tiny_copy(header=_nan_weight),
        "no_tokenizer": _then(_tiny_copy(), _no_tokenizer),
        "fake_parquet": lambda w: (w / "data.parquet").write_text("text\nnot parquet at all\n"),
        "parquet_dir": lambda w: ((w / "data").mkdir(), (w / "data" / "a.parquet").write_bytes(b"PAR1 cut short")),
        "csv_data": lambda w: (w / "data.csv").write_text("text\nhello\n"),
        "recipe_binary": _recipe_bytes(bytes(range(256))),
        "recipe_latin1": _recipe_bytes(
            "model: builtin:tiny-moe\n# café\npasses:\n  - quantize: {}\n".encode("latin-1")
        ),
        "recipe_huge": _recipe_bytes(b"# padding\n" * 120_000),
        "recipe_directory": lambda w: (w / "recipe.yaml").mkdir(),
    }
)


# issue 40: ignored options and recipes
_BOMB = "\n".join(
    ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    + [f"{chr(98 + i)}: &{chr(98 + i)} [{','.join(['*' + chr(97 + i)] * 9)}]" for i in range(8)]
)
SETUPS.update(
    {
        "dup_passes": _recipe("model: builtin:tiny-moe\npasses: [{quantize: {}}]\npasses: [{prune_experts: {}}]\n"),
        "dup_nested": _recipe("model: builtin:tiny-moe\npasses:\n  - quantize: {scheme: int4, scheme: int2}\n"),
        "alias": _recipe("model: &m builtin:tiny-moe\nx: *m\npasses: [{quantize: {}}]\n"),
        "alias_bomb": _recipe(_BOMB + "\nmodel: *i\npasses: [{quantize: {}}]\n"),
        "r_gptq_damp": _recipe("model: builtin:tiny-moe\npasses:\n  - quantize: {method: rtn, gptq_damp: 0.1}\n"),
        "r_rank_alloc": _recipe(
            "model: builtin:tiny-moe\npasses:\n  - quantize: {}\n  - lowrank: {rank_alloc: uniform}\n"
        ),
        "r_budget_nan": _recipe(
            "model: builtin:tiny-moe\npasses:\n  - quantize: {}\n  - lowrank: {lowrank_budget: .nan}\n"
        ),
        "r_budget_big": _recipe(
            "model: builtin:tiny-moe\npasses:\n  - quantize: {}\n  - lowrank: {lowrank_budget: 12}\n"
        ),
        "r_min_keep": _recipe("model: builtin:tiny-moe\npasses:\n  - prune_experts: {scope: layer, min_keep: 3}\n"),
        "r_calib_rtn": _recipe(
            "model: builtin:tiny-moe\ncalibration: {tokens: 4096}\npasses:\n  - quantize: {scheme: int4}\n"
        ),
        "r_seq_len": _recipe(
            "model: builtin:tiny-moe\ncalibration: {seq_len: 100000, tokens: 200000}\npasses:\n"
            "  - prune_experts: {ratio: 0.25}\n"
        ),
        "r_eval_tokens": _recipe("model: builtin:tiny-moe\npasses:\n  - quantize: {}\n  - eval: {tokens: 1}\n"),
        "r_ratio_inf": _recipe("model: builtin:tiny-moe\npasses:\n  - prune_experts: {ratio: .inf}\n"),
        "r_heads_steps": _recipe(
            "model: builtin:tiny-moe\npasses:\n  - prune_heads: {ratio: 0.5, method: magnitude, steps: 10}\n"
        ),
        "r_replay_weights": _recipe("model: builtin:tiny-moe\npasses:\n  - qat: {replay_weights: recorded}\n"),
        "r_long_key": _recipe("model: builtin:tiny-moe\npasses:\n  - quantize: {" + "k" * 1000 + ": 1}\n"),
        "r_not_a_number": _recipe("model: builtin:tiny-moe\npasses:\n  - prune_experts: {ratio: a lot}\n"),
        "r_greedy_reap": _recipe("model: builtin:tiny-moe\npasses:\n  - prune_experts: {method: reap, greedy: true}\n"),
        "r_image_size": _recipe(
            "model: builtin:tiny-moe\ncalibration: {image_size: 64}\npasses:\n  - prune_experts: {}\n"
        ),
    }
)


CASES: tuple[Case, ...] = (
    # inspect
    Case("inspect-missing", ("inspect", "{w}/nowhere"), "no such model directory"),
    Case("inspect-empty-dir", ("inspect", "{w}/empty"), "config.json", "empty_dir"),
    Case("inspect-bad-config", ("inspect", "{w}/m"), "config.json", "bad_json"),
    Case("inspect-dense", ("inspect", "{s}/dense"), "has no MoE layers"),
    Case("inspect-unsupported", ("inspect", "{s}/made_up_moe"), "unsupported MoE family 'made_up_moe'"),
    Case("inspect-file", ("inspect", "{w}/afile"), "afile", "a_file"),
    # eval
    Case("eval-seq-len-beyond-positions", ("eval", TINY, "--seq-len", "100000"), "max_position_embeddings"),
    Case("eval-missing-data", ("eval", TINY, "--eval-data", "{w}/none.txt"), "no such data file"),
    Case("eval-unknown-builtin", ("eval", TINY, "--eval-data", "builtin:poetry"), "unknown built-in source"),
    Case("eval-tokens-below-window", ("eval", TINY, "--eval-tokens", "100"), "less than one window"),
    Case("eval-tokens-not-a-number", ("eval", TINY, "--eval-tokens", "many"), "not a whole number or 'all'"),
    Case("eval-missing-reference", ("eval", TINY, "--reference", "{w}/nowhere"), "no such model directory"),
    Case("eval-seq-len-1", ("eval", TINY, "--seq-len", "1"), "--seq-len"),
    # prune
    Case("prune-keep-above-experts", ("prune", TINY, "--out", OUT, "--keep", "9"), "8 experts per layer"),
    Case("prune-keep-below-top-k", ("prune", TINY, "--out", OUT, "--keep", "1"), "fewer than the minimum 2"),
    Case("prune-keep-all", ("prune", TINY, "--out", OUT, "--keep", "8"), "keep fewer"),
    Case(
        "prune-min-keep-above-experts",
        ("prune", TINY, "--out", OUT, "--scope", "global", "--min-keep", "10"),
        "--min-keep 10",
    ),
    Case("prune-ratio-uneven", ("prune", TINY, "--out", OUT, "--ratio", "0.3"), "do not split evenly"),
    Case("prune-ratio-above-1", ("prune", TINY, "--out", OUT, "--ratio", "1.5"), "between 0 and 1"),
    Case("prune-ratio-removes-none", ("prune", TINY, "--out", OUT, "--ratio", "0.01"), "nothing to remove"),
    Case("prune-ratio-and-keep", ("prune", TINY, "--out", OUT, "--ratio", "0.5", "--keep", "4"), "exactly one"),
    Case(
        "prune-global-ratio-too-high",
        ("prune", TINY, "--out", OUT, "--scope", "global", "--ratio", "0.9"),
        "while keeping at least 2 per layer",
    ),
    Case(
        "prune-low-attention-fraction",
        ("prune", TINY, "--out", OUT, "--low-attention-fraction", "0"),
        "--low-attention-fraction",
    ),
    Case("prune-seq-len-beyond-positions", ("prune", TINY, "--out", OUT, "--seq-len", "100000"), "max_position"),
    Case("prune-calib-below-window", ("prune", TINY, "--out", OUT, "--calib-tokens", "100"), "less than one window"),
    Case("prune-missing-calib", ("prune", TINY, "--out", OUT, "--calib", "{w}/none.txt"), "no such data file"),
    Case("prune-missing-eval-data", ("prune", TINY, "--out", OUT, "--eval-data", "hf:"), "needs a dataset name"),
    Case("prune-out-exists", ("prune", TINY, "--out", OUT), "output directory exists", "out_exists"),
    Case("prune-out-unwritable", ("prune", TINY, "--out", "/sys/moecompress-out"), "cannot write in /sys"),
    Case("prune-out-under-a-file", ("prune", TINY, "--out", "{w}/afile/out"), "is not a directory", "a_file"),
    Case("prune-out-inside-input", ("prune", "{s}/copy", "--out", "{s}/copy/out"), "may not be the input"),
    Case("prune-partial-run-left", ("prune", TINY, "--out", OUT), "--resume, or discard it", "partial_run"),
    Case("prune-resume-and-restart", ("prune", TINY, "--out", OUT, "--resume", "--restart"), "exclude each other"),
    Case("prune-quiet-and-log-json", ("prune", TINY, "--out", OUT, "--quiet", "--log-json"), "exclude each other"),
    Case("prune-native-quantised", ("prune", "{s}/native", "--out", OUT), "already quantised"),
    Case("prune-unknown-method", ("prune", TINY, "--out", OUT, "--method", "magic"), "--method"),
    Case("prune-missing-out", ("prune", TINY), "--out"),
    # quantize
    Case("quantize-mxfp4-group-128", ("quantize", TINY, "--out", OUT, "--group-size", "128"), "always 32 wide"),
    Case(
        "quantize-int4-group-256",
        ("quantize", TINY, "--out", OUT, "--scheme", "int4", "--group-size", "256"),
        "group size must be one of",
    ),
    Case(
        "quantize-salient-gpt-oss",
        ("quantize", TINY, "--out", OUT, "--salient-fraction", "0.01", "--format", "gpt-oss"),
        "native format only",
    ),
    Case(
        "quantize-lowrank-compressed-tensors",
        ("quantize", TINY, "--out", OUT, "--lowrank-budget", "0.25", "--format", "compressed-tensors"),
        "native format only",
    ),
    Case("quantize-gpt-oss-layout", ("quantize", TINY, "--out", OUT, "--format", "gpt-oss"), "GPT-OSS family"),
    Case("quantize-unknown-target", ("quantize", TINY, "--out", OUT, "--targets", "experts,mlp"), "targets must"),
    Case("quantize-without-experts", ("quantize", TINY, "--out", OUT, "--targets", "attention"), "targets must"),
    Case("quantize-native-quantised", ("quantize", "{s}/native", "--out", OUT), "already quantised"),
    Case(
        "quantize-seq-len-beyond-positions",
        ("quantize", TINY, "--out", OUT, "--method", "gptq", "--seq-len", "100000"),
        "max_position_embeddings",
    ),
    Case("quantize-partial-run-left", ("quantize", TINY, "--out", OUT), "--restart", "partial_run"),
    # qat
    Case(
        "qat-rank-and-budget",
        ("qat", TINY, "--out", OUT, "--scheme", "int2", "--adapter-rank", "4", "--lowrank-budget", "0.5"),
        "not both",
    ),
    Case("qat-bad-replay", ("qat", TINY, "--out", OUT, "--scheme", "int2", "--replay", "sometimes"), "replay"),
    Case(
        "qat-seq-len-beyond-positions",
        ("qat", TINY, "--out", OUT, "--scheme", "int2", "--seq-len", "100000"),
        "max_position_embeddings",
    ),
    Case("qat-missing-calib", ("qat", TINY, "--out", OUT, "--scheme", "int2", "--calib", "{w}/x.txt"), "no such"),
    Case("qat-partial-left", ("qat", TINY, "--out", OUT, "--scheme", "int2"), "--resume, or discard", "partial_writer"),
    Case("qat-native-quantised", ("qat", "{s}/native", "--out", OUT, "--scheme", "int2"), "already quantised"),
    # prune-heads
    Case("prune-heads-removes-all", ("prune-heads", TINY, "--out", OUT, "--ratio", "0.9"), "removes every one"),
    Case("prune-heads-removes-none", ("prune-heads", TINY, "--out", OUT, "--ratio", "0.1"), "removes none"),
    Case(
        "prune-heads-global-query-heads",
        ("prune-heads", TINY, "--out", OUT, "--ratio", "0.5", "--scope", "global", "--unit", "query-head"),
        "--scope global ranks KV groups",
    ),
    Case(
        "prune-heads-partial-left",
        ("prune-heads", TINY, "--out", OUT, "--ratio", "0.5"),
        "--resume, or discard",
        "partial_writer",
    ),
    # run
    Case("run-missing-recipe", ("run", "{w}/none.yaml", "--out", OUT), "cannot read the recipe"),
    Case("run-bad-yaml", ("run", "{w}/recipe.yaml", "--out", OUT), "not valid YAML", "bad_yaml"),
    Case("run-unknown-key", ("run", "{w}/recipe.yaml", "--out", OUT), "modle: unknown key", "unknown_key"),
    Case("run-lowrank-first", ("run", "{w}/recipe.yaml", "--out", OUT), "directly follow", "lowrank_first"),
    Case("run-prune-after-quantize", ("run", "{w}/recipe.yaml", "--out", OUT), "before", "prune_after_quantize"),
    Case("run-keep-above-experts", ("run", "{w}/recipe.yaml", "--out", OUT), "8 experts per layer", "keep_9"),
    Case("run-short-calibration", ("run", "{w}/recipe.yaml", "--out", OUT), "less than one", "short_calibration"),
    Case("run-no-model", ("run", "{w}/recipe.yaml", "--out", OUT), "no model", "no_model"),
    Case("run-unknown-scheme", ("run", "{w}/recipe.yaml", "--out", OUT), "passes[0].quantize", "bad_scheme"),
    Case("run-no-out", ("run", DEFAULT_RECIPE), "--out is required"),
    Case("run-partial-run-left", ("run", DEFAULT_RECIPE, "--out", OUT), "--resume", "partial_run"),
    # issue 40: overwrite, input, lock
    Case(
        "quantize-overwrite-not-an-output",
        ("quantize", TINY, "--out", "{w}/proj", "--overwrite"),
        "not a moecompress output",
        "project_dir",
    ),
    Case(
        "export-overwrite-not-an-output",
        ("export", TINY, "--format", "bf16", "--out", "{w}/proj", "--overwrite"),
        "not a moecompress output",
        "project_dir",
    ),
    Case("prune-out-around-input", ("prune", "{s}/copy", "--out", "{s}", "--overwrite"), "may not be the input"),
    Case(
        "eval-json-out-into-input",
        ("eval", "{s}/copy", "--json-out", "{s}/copy/config.json"),
        "never writes into its input",
    ),
    Case(
        "eval-json-out-into-reference",
        ("eval", TINY, "--reference", "{s}/copy", "--json-out", "{s}/copy/eval.json"),
        "never writes into its input",
    ),
    Case(
        "report-plot-into-a-run",
        ("report", "{w}/empty", "--plot", "{w}/empty/plot.png"),
        "never writes into its input",
        "empty_dir",
    ),
    Case(
        "export-out-inside-input",
        ("export", "{s}/copy", "--format", "gguf", "--out", "{s}/copy/m.gguf"),
        "never writes into its input",
    ),
    Case(
        "run-overwrite-deletes-the-recipe",
        ("run", "{w}/out/recipe.yaml", "--out", OUT, "--overwrite"),
        "which overwriting it would delete",
        "inputs_in_output",
    ),
    Case(
        "prune-overwrite-deletes-the-calibration",
        ("prune", TINY, "--out", OUT, "--overwrite", "--calib", "{w}/out/notes.txt", "--calib-tokens", "256"),
        "which overwriting it would delete",
        "inputs_in_output",
    ),
    Case(
        "export-out-unwritable", ("export", TINY, "--format", "bf16", "--out", "/sys/moecompress-out"), "cannot write"
    ),
    Case("quantize-out-locked", ("quantize", TINY, "--out", OUT), "another moecompress run (pid 4242", "locked"),
    Case(
        "quantize-resume-locked",
        ("quantize", TINY, "--out", OUT, "--resume"),
        "another moecompress run (pid 4242",
        "locked_partial",
    ),
    Case(
        "quantize-restart-locked",
        ("quantize", TINY, "--out", OUT, "--restart"),
        "another moecompress run (pid 4242",
        "locked_partial",
    ),
    # issue 40: consistency on read
    Case("inspect-config-hidden-size", ("inspect", "{w}/m"), "says hidden_size 256", "cfg_hidden"),
    Case("inspect-config-more-layers", ("inspect", "{w}/m"), "says num_hidden_layers 6", "cfg_more_layers"),
    Case("inspect-config-fewer-layers", ("inspect", "{w}/m"), "tensors of layer 3", "cfg_fewer_layers"),
    Case("inspect-config-vocab-size", ("inspect", "{w}/m"), "says vocab_size 4096", "cfg_vocab"),
    Case("inspect-config-expert-count", ("inspect", "{w}/m"), "says 16 experts, weights hold 8", "cfg_experts"),
    Case("inspect-config-expert-width", ("inspect", "{w}/m"), "expert width 512", "cfg_expert_width"),
    Case("inspect-config-array", ("inspect", "{w}/m"), "must hold a JSON object, not an array", "cfg_array"),
    Case("inspect-config-size-string", ("inspect", "{w}/m"), "hidden_size is a string", "cfg_size_string"),
    Case("inspect-weights-directory", ("inspect", "{w}/m"), "a directory, not a safetensors file", "weights_directory"),
    Case("inspect-safetensors-overlap", ("inspect", "{w}/m"), "overlaps", "st_overlap"),
    Case("inspect-safetensors-shape-size", ("inspect", "{w}/m"), "its data_offsets span 256", "st_shape_size"),
    Case("inspect-safetensors-trailing", ("inspect", "{w}/m"), "64 bytes after the last tensor", "st_trailing"),
    Case("inspect-hub-id-offline", ("inspect", "no-such-org/no-such-model"), "HF_HUB_OFFLINE is set"),
    Case("eval-config-vocab-size", ("eval", "{w}/m"), "says vocab_size 4096", "cfg_vocab"),
    Case(
        "eval-reference-config-layers",
        ("eval", TINY, "--reference", "{w}/m"),
        "says num_hidden_layers 6",
        "cfg_more_layers",
    ),
    Case("eval-no-tokenizer", ("eval", "{w}/m"), "no tokenizer", "no_tokenizer"),
    Case("eval-fake-parquet", ("eval", TINY, "--eval-data", "{w}/data.parquet"), "not a parquet file", "fake_parquet"),
    Case("eval-json-out-missing-dir", ("eval", TINY, "--json-out", "{w}/nowhere/eval.json"), "does not exist"),
    Case("eval-json-out-directory", ("eval", TINY, "--json-out", "{w}/empty"), "is a directory", "empty_dir"),
    Case("prune-config-hidden-size", ("prune", "{w}/m", "--out", OUT), "says hidden_size 256", "cfg_hidden"),
    Case("prune-safetensors-overlap", ("prune", "{w}/m", "--out", OUT), "overlaps", "st_overlap"),
    Case("prune-no-tokenizer", ("prune", "{w}/m", "--out", OUT), "no tokenizer", "no_tokenizer"),
    Case(
        "prune-parquet-dir", ("prune", TINY, "--out", OUT, "--calib", "{w}/data"), "not a parquet file", "parquet_dir"
    ),
    Case("prune-csv-data", ("prune", TINY, "--out", OUT, "--calib", "{w}/data.csv"), "unsupported data", "csv_data"),
    Case("quantize-config-expert-count", ("quantize", "{w}/m", "--out", OUT), "says 16 experts", "cfg_experts"),
    Case(
        "quantize-index-shard-directory",
        ("quantize", "{w}/m", "--out", OUT),
        "which is a directory",
        "index_shard_directory",
    ),
    Case(
        "quantize-index-shard-missing", ("quantize", "{w}/m", "--out", OUT), "which is missing", "index_shard_missing"
    ),
    Case(
        "quantize-index-shard-outside", ("quantize", "{w}/m", "--out", OUT), "outside the model", "index_shard_outside"
    ),
    Case("quantize-safetensors-bad-shape", ("quantize", "{w}/m", "--out", OUT), "not a list of whole", "st_bad_shape"),
    Case(
        "quantize-gptq-no-tokenizer",
        ("quantize", "{w}/m", "--out", OUT, "--method", "gptq"),
        "no tokenizer",
        "no_tokenizer",
    ),
    Case(
        "qat-config-fewer-layers",
        ("qat", "{w}/m", "--out", OUT, "--scheme", "int2"),
        "tensors of layer 3",
        "cfg_fewer_layers",
    ),
    Case(
        "qat-fake-parquet",
        ("qat", TINY, "--out", OUT, "--scheme", "int2", "--calib", "{w}/data.parquet"),
        "PAR1",
        "fake_parquet",
    ),
    Case(
        "prune-heads-config-text-config",
        ("prune-heads", "{w}/m", "--out", OUT, "--ratio", "0.5"),
        "text_config must be an object",
        "cfg_text_config_list",
    ),
    Case(
        "prune-heads-no-tokenizer",
        ("prune-heads", "{w}/m", "--out", OUT, "--ratio", "0.5"),
        "no tokenizer",
        "no_tokenizer",
    ),
    Case(
        "prune-heads-nan-weight",
        ("prune-heads", "{w}/m", "--out", OUT, "--ratio", "0.5"),
        "holds NaN or Inf",
        "nan_weight",
    ),
    Case("quantize-nan-weight", ("quantize", "{w}/m", "--out", OUT), "q_proj.weight' holds NaN", "nan_weight"),
    Case("eval-nan-weight", ("eval", "{w}/m"), "q_proj.weight' holds NaN", "nan_weight"),
    Case("run-recipe-binary", ("run", "{w}/recipe.yaml", "--out", OUT), "a binary file", "recipe_binary"),
    Case("run-recipe-not-utf8", ("run", "{w}/recipe.yaml", "--out", OUT), "not UTF-8 text", "recipe_latin1"),
    Case("run-recipe-too-large", ("run", "{w}/recipe.yaml", "--out", OUT), "at most 1 MB", "recipe_huge"),
    Case(
        "run-recipe-directory",
        ("run", "{w}/recipe.yaml", "--out", OUT),
        "is a directory",
        "recipe_directory",
    ),
    Case(
        "run-recipe-model-layers",
        ("run", "{w}/recipe.yaml", "--out", OUT),
        "says num_hidden_layers 6",
        "cfg_layers_recipe",
    ),
    Case(
        "export-weights-directory",
        ("export", "{w}/m", "--format", "bf16", "--out", "{w}/o"),
        "a directory, not a",
        "weights_directory",
    ),
    Case(
        "export-config-array",
        ("export", "{w}/m", "--format", "gguf", "--out", "{w}/o.gguf"),
        "JSON object",
        "cfg_array",
    ),
    Case(
        "report-plot-missing-dir", ("report", "{w}/empty", "--plot", "{w}/nowhere/p.png"), "does not exist", "empty_dir"
    ),
    # report, push
    Case("report-missing", ("report", "{w}/nowhere"), "no such directory"),
    Case("report-not-an-output", ("report", "{w}/empty"), "not a moecompress output", "empty_dir"),
    Case("push-missing", ("push", "{w}/nowhere", "--repo-id", "me/t", "--dry-run"), "no such directory"),
    Case(
        "push-not-an-output", ("push", "{w}/empty", "--repo-id", "me/t", "--dry-run"), "not a moecompress", "empty_dir"
    ),
    Case("push-bad-repo-id", ("push", "{s}/copy", "--repo-id", "no-slash", "--dry-run"), "expected ORG/NAME"),
    # issue 40: ignored options and recipes
    Case("prune-min-keep-layer-scope", ("prune", TINY, "--out", OUT, "--min-keep", "3"), "--min-keep 3 applies only"),
    Case("prune-greedy-reap", ("prune", TINY, "--out", OUT, "--method", "reap", "--greedy"), "--greedy applies only"),
    Case(
        "prune-preserve-tags-frequency",
        ("prune", TINY, "--out", OUT, "--method", "frequency", "--preserve-tags", "code"),
        "--preserve-tags code applies only with --method maep",
    ),
    Case(
        "prune-aggregate-random",
        ("prune", TINY, "--out", OUT, "--method", "random", "--aggregate", "mean"),
        "--aggregate mean applies only",
    ),
    Case(
        "prune-low-attention-without-prune-tags",
        ("prune", TINY, "--out", OUT, "--low-attention-fraction", "0.3"),
        "applies only with --method maep and --prune-tags",
    ),
    Case("prune-weight-without-prune-tags", ("prune", TINY, "--out", OUT, "--prune-weight", "0.7"), "--prune-tags"),
    Case("prune-ratio-nan", ("prune", TINY, "--out", OUT, "--ratio", "nan"), "nan is not a finite number"),
    Case("prune-ratio-inf", ("prune", TINY, "--out", OUT, "--ratio", "inf"), "inf is not a finite number"),
    Case(
        "prune-low-attention-nan",
        ("prune", TINY, "--out", OUT, "--prune-tags", "code", "--low-attention-fraction", "nan"),
        "not a finite number",
    ),
    Case(
        "prune-eval-tokens-no-eval",
        ("prune", TINY, "--out", OUT, "--no-eval", "--eval-tokens", "512"),
        "--eval-tokens applies only with an evaluation",
    ),
    Case(
        "prune-eval-data-no-eval",
        ("prune", TINY, "--out", OUT, "--no-eval", "--eval-data", "builtin:code"),
        "--eval-data applies only with an evaluation",
    ),
    Case(
        "prune-image-size-text-source",
        ("prune", TINY, "--out", OUT, "--image-size", "64"),
        "--image-size applies only with an image calibration source",
    ),
    Case(
        "quantize-asymmetric-mxfp4",
        ("quantize", TINY, "--out", OUT, "--asymmetric"),
        "--asymmetric applies only with --scheme int4, int2 or w4a8",
    ),
    Case(
        "quantize-symmetric-binary",
        ("quantize", TINY, "--out", OUT, "--scheme", "binary", "--symmetric"),
        "--symmetric applies only",
    ),
    Case(
        "quantize-scale-rule-int4",
        ("quantize", TINY, "--out", OUT, "--scheme", "int4", "--scale-rule", "ceil"),
        "--scale-rule ceil applies only with --scheme mxfp4",
    ),
    Case(
        "quantize-gptq-damp-rtn",
        ("quantize", TINY, "--out", OUT, "--gptq-damp", "0.1"),
        "--gptq-damp 0.1 applies only with --method gptq",
    ),
    Case("quantize-gptq-min-tokens-rtn", ("quantize", TINY, "--out", OUT, "--gptq-min-tokens", "8"), "--method gptq"),
    Case(
        "quantize-bitmap-without-salient",
        ("quantize", TINY, "--out", OUT, "--bitmap", "golomb"),
        "applies only with --salient-fraction above 0",
    ),
    Case(
        "quantize-rank-alloc-without-budget",
        ("quantize", TINY, "--out", OUT, "--rank-alloc", "uniform"),
        "--rank-alloc uniform applies only with --lowrank-budget above 0",
    ),
    Case(
        "quantize-sensitivity-without-adapters",
        ("quantize", TINY, "--out", OUT, "--sensitivity", "none"),
        "--sensitivity none applies only",
    ),
    Case(
        "quantize-load-weighting-without-adapters",
        ("quantize", TINY, "--out", OUT, "--load-weighting", "tokens"),
        "--load-weighting tokens applies only",
    ),
    Case(
        "quantize-seed-rtn", ("quantize", TINY, "--out", OUT, "--seed", "3"), "--seed 3 applies only with calibration"
    ),
    Case(
        "quantize-calib-rtn",
        ("quantize", TINY, "--out", OUT, "--calib", "builtin:code"),
        "--calib applies only with a pass that calibrates",
    ),
    Case(
        "quantize-calib-tokens-rtn",
        ("quantize", TINY, "--out", OUT, "--calib-tokens", "4096"),
        "--calib-tokens applies only with a pass that calibrates",
    ),
    Case(
        "quantize-seq-len-rtn-no-eval",
        ("quantize", TINY, "--out", OUT, "--no-eval", "--seq-len", "128"),
        "--seq-len applies only with calibration or an evaluation",
    ),
    Case(
        "quantize-lowrank-budget-nan",
        ("quantize", TINY, "--out", OUT, "--lowrank-budget", "nan"),
        "nan is not a finite number",
    ),
    Case(
        "quantize-lowrank-budget-inf",
        ("quantize", TINY, "--out", OUT, "--lowrank-budget", "inf"),
        "inf is not a finite number",
    ),
    Case(
        "quantize-lowrank-budget-larger-than-input",
        ("quantize", TINY, "--out", OUT, "--lowrank-budget", "12"),
        "would make the experts at least 16.250 bits per weight",
    ),
    Case(
        "quantize-int2-budget-larger-than-input",
        ("quantize", TINY, "--out", OUT, "--scheme", "int2", "--lowrank-budget", "15"),
        "not fewer than the input's 16.000",
    ),
    Case(
        "quantize-salient-fraction-nan",
        ("quantize", TINY, "--out", OUT, "--salient-fraction", "nan"),
        "not a finite number",
    ),
    Case(
        "quantize-gptq-damp-inf",
        ("quantize", TINY, "--out", OUT, "--method", "gptq", "--gptq-damp", "inf"),
        "not a finite number",
    ),
    Case(
        "qat-replay-weights-without-replay",
        ("qat", TINY, "--out", OUT, "--scheme", "int2", "--replay-weights", "recorded"),
        "--replay-weights recorded applies only with --replay other than none",
    ),
    Case(
        "qat-rank-alloc-with-adapter-rank",
        ("qat", TINY, "--out", OUT, "--scheme", "int2", "--adapter-rank", "4", "--rank-alloc", "uniform"),
        "--rank-alloc uniform applies only with --lowrank-budget above 0",
    ),
    Case(
        "qat-asymmetric-mxfp4",
        ("qat", TINY, "--out", OUT, "--scheme", "mxfp4", "--asymmetric"),
        "--asymmetric applies only",
    ),
    Case("qat-lr-nan", ("qat", TINY, "--out", OUT, "--scheme", "int2", "--lr", "nan"), "not a finite number"),
    Case(
        "qat-budget-larger-than-input",
        ("qat", TINY, "--out", OUT, "--scheme", "int2", "--lowrank-budget", "14"),
        "not fewer than the input's",
    ),
    Case(
        "qat-eval-tokens-no-eval",
        ("qat", TINY, "--out", OUT, "--scheme", "int2", "--no-eval", "--eval-tokens", "512"),
        "--eval-tokens applies only with an evaluation",
    ),
    Case(
        "prune-heads-steps-magnitude",
        ("prune-heads", TINY, "--out", OUT, "--ratio", "0.5", "--method", "magnitude", "--steps", "10"),
        "--steps 10 applies only with --method learned",
    ),
    Case(
        "prune-heads-gate-objective-random",
        ("prune-heads", TINY, "--out", OUT, "--ratio", "0.5", "--method", "random", "--gate-objective", "kl"),
        "--gate-objective kl applies only",
    ),
    Case(
        "prune-heads-distill-lr-without-distillation",
        ("prune-heads", TINY, "--out", OUT, "--ratio", "0.5", "--distill-steps", "0", "--distill-lr", "0.001"),
        "--distill-lr 0.001 applies only with --distill-steps above 0",
    ),
    Case(
        "prune-heads-noise-bias-magnitude",
        ("prune-heads", TINY, "--out", OUT, "--ratio", "0.5", "--method", "magnitude", "--noise-bias", "1.0"),
        "--noise-bias 1.0 applies only",
    ),
    Case("prune-heads-lr-nan", ("prune-heads", TINY, "--out", OUT, "--ratio", "0.5", "--lr", "nan"), "not a finite"),
    Case(
        "prune-heads-eval-data-no-eval",
        ("prune-heads", TINY, "--out", OUT, "--ratio", "0.5", "--no-eval", "--eval-data", "builtin:code"),
        "--eval-data applies only with an evaluation",
    ),
    Case("run-duplicate-passes", ("run", "{w}/recipe.yaml", "--out", OUT), "duplicate key 'passes'", "dup_passes"),
    Case("run-duplicate-nested-key", ("run", "{w}/recipe.yaml", "--out", OUT), "duplicate key 'scheme'", "dup_nested"),
    Case("run-alias", ("run", "{w}/recipe.yaml", "--out", OUT), "recipes do not take YAML aliases", "alias"),
    Case("run-alias-bomb", ("run", "{w}/recipe.yaml", "--out", OUT), "recipes do not take YAML aliases", "alias_bomb"),
    Case(
        "run-gptq-damp-rtn",
        ("run", "{w}/recipe.yaml", "--out", OUT),
        "passes[0].quantize.gptq_damp 0.1 applies only with passes[0].quantize.method gptq",
        "r_gptq_damp",
    ),
    Case(
        "run-lowrank-rank-alloc-without-budget",
        ("run", "{w}/recipe.yaml", "--out", OUT),
        "passes[1].lowrank.rank_alloc uniform applies only",
        "r_rank_alloc",
    ),
    Case(
        "run-lowrank-budget-nan",
        ("run", "{w}/recipe.yaml", "--out", OUT),
        "passes[1].lowrank.lowrank_budget nan is not a finite number",
        "r_budget_nan",
    ),
    Case(
        "run-lowrank-budget-larger-than-input",
        ("run", "{w}/recipe.yaml", "--out", OUT),
        "passes[1].lowrank.lowrank_budget 12.0 would make the experts",
        "r_budget_big",
    ),
    Case(
        "run-min-keep-layer-scope",
        ("run", "{w}/recipe.yaml", "--out", OUT),
        "passes[0].prune_experts.min_keep 3 applies only with passes[0].prune_experts.scope global",
        "r_min_keep",
    ),
    Case(
        "run-calibration-with-rtn",
        ("run", "{w}/recipe.yaml", "--out", OUT),
        "calibration.tokens applies only with a pass that calibrates",
        "r_calib_rtn",
    ),
    Case(
        "run-seq-len-beyond-positions",
        ("run", "{w}/recipe.yaml", "--out", OUT),
        "calibration.seq_len 100000 exceeds the model's max_position_embeddings",
        "r_seq_len",
    ),
    Case(
        "run-eval-tokens-1",
        ("run", "{w}/recipe.yaml", "--out", OUT),
        "passes[1].eval.tokens 1 must be",
        "r_eval_tokens",
    ),
    Case("run-ratio-inf", ("run", "{w}/recipe.yaml", "--out", OUT), "ratio inf is not a finite", "r_ratio_inf"),
    Case(
        "run-heads-steps-magnitude",
        ("run", "{w}/recipe.yaml", "--out", OUT),
        "passes[0].prune_heads.steps 10 applies only with passes[0].prune_heads.method learned",
        "r_heads_steps",
    ),
    Case(
        "run-qat-replay-weights",
        ("run", "{w}/recipe.yaml", "--out", OUT),
        "passes[0].qat.replay_weights recorded applies only",
        "r_replay_weights",
    ),
    Case("run-long-unknown-key", ("run", "{w}/recipe.yaml", "--out", OUT), "kkk...: unknown key", "r_long_key"),
    Case(
        "run-ratio-not-a-number",
        ("run", "{w}/recipe.yaml", "--out", OUT),
        "passes[0].prune_experts.ratio a lot is not a number",
        "r_not_a_number",
    ),
    Case(
        "run-greedy-reap",
        ("run", "{w}/recipe.yaml", "--out", OUT),
        "passes[0].prune_experts.greedy true applies only",
        "r_greedy_reap",
    ),
    Case(
        "run-image-size-text-source",
        ("run", "{w}/recipe.yaml", "--out", OUT),
        "calibration.image_size applies only",
        "r_image_size",
    ),
)


def prepare_shared(shared: Path) -> None:
    """Models the cases read (never write): a copy of tiny-moe, one marked as moecompress's native quantised
    output, a dense model and an unsupported family (their config.json alone decides the refusal)."""
    from moecompress.checkpoint import resolve_model

    tiny = resolve_model(TINY)
    shutil.copytree(tiny, shared / "copy")
    for name, edit in (
        ("native", lambda c: c.update(quantization_config={"quant_method": "moecompress"})),
        ("dense", lambda c: (c.clear(), c.update(model_type="llama", num_hidden_layers=2))),
        ("made_up_moe", lambda c: c.update(model_type="made_up_moe", architectures=["MadeUpMoeForCausalLM"])),
    ):
        target = shared / name
        shutil.copytree(tiny, target)
        config = json.loads((target / "config.json").read_text())
        edit(config)
        (target / "config.json").write_text(json.dumps(config, indent=2))


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str


def run_case(argv: list[str]) -> Outcome:
    """The console entry point in this process, as ``moecompress ARGV``."""
    from moecompress import progress
    from moecompress.cli.main import main

    progress.configure()
    out, err = io.StringIO(), io.StringIO()
    saved = sys.argv
    sys.argv = ["moecompress", *argv]
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    finally:
        sys.argv = saved
        progress.configure()
    return Outcome(code, out.getvalue(), err.getvalue())


def listing(directory: Path) -> list[str]:
    """Every path under ``directory`` (hidden ones included), with each file's size."""
    return sorted(
        f"{p.relative_to(directory)}:{p.stat().st_size if p.is_file() else 'dir'}" for p in directory.rglob("*")
    )


def check(case: Case, root: Path, shared: Path) -> tuple[Outcome, list[str]]:
    """Run ``case`` in a fresh directory under ``root``; the problems found (empty when it behaves)."""
    work = root / case.id
    work.mkdir()
    if case.setup:
        SETUPS[case.setup](work)
    before, shared_before = listing(work), listing(shared)
    outcome = run_case(case.argv(work, shared))
    problems = []
    lines = outcome.stderr.strip().splitlines()
    if outcome.code != 2:
        problems.append(f"exit code {outcome.code}, not 2")
    if len(lines) != 1:
        problems.append(f"{len(lines)} lines on stderr, not 1: {outcome.stderr[-2000:]!r}")
    elif case.expect not in lines[0]:
        problems.append(f"{case.expect!r} not in {lines[0]!r}")
    if "Traceback" in outcome.stderr:
        problems.append("a traceback")
    if listing(work) != before:
        problems.append(f"wrote into its directory: {sorted(set(listing(work)) ^ set(before))}")
    if listing(shared) != shared_before:
        problems.append("changed a shared input model")
    return outcome, problems


def _display(text: str, root: Path, shared: Path) -> str:
    return text.replace(str(shared), "MODELS").replace(str(root) + "/", "").replace("|", "\\|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", type=Path, help="Write the table to this file (docs/bad_input.md).")
    args = parser.parse_args()
    rows, failures = [], 0
    with tempfile.TemporaryDirectory() as temporary:
        root, shared = Path(temporary) / "cases", Path(temporary) / "models"
        root.mkdir()
        shared.mkdir()
        prepare_shared(shared)
        for case in CASES:
            outcome, problems = check(case, root, shared)
            failures += bool(problems)
            line = outcome.stderr.strip().splitlines()[0] if outcome.stderr.strip() else ""
            command = "moecompress " + " ".join(case.args).replace("{w}/", "").replace("{s}", "MODELS")
            command = command.replace(str(ROOT) + "/", "")
            rows.append((case.id, command, outcome.code, _display(line, root / case.id, shared), problems))
            print(f"{'FAIL' if problems else 'ok  '} {case.id}: {'; '.join(problems) or line}", file=sys.stderr)
    table = [
        "| # | case | command | exit | the one line on stderr |",
        "|---|---|---|---|---|",
        *(
            f"| {i} | {case_id} | `{command}` | {code} | {line} |"
            for i, (case_id, command, code, line, _) in enumerate(rows, start=1)
        ),
    ]
    if args.markdown:
        text = args.markdown.read_text() if args.markdown.exists() else ""
        head = text.split("<!-- table -->")[0] if "<!-- table -->" in text else text
        args.markdown.write_text(head.rstrip("\n") + "\n\n<!-- table -->\n" + "\n".join(table) + "\n")
    else:
        print("\n".join(table))
    if failures:
        sys.exit(f"{failures} of {len(CASES)} cases did not give exit 2 and one line")


if __name__ == "__main__":
    main()
