"""Finding llama.cpp's converter and running it (through :mod:`.convert_driver`): in this process with its modules
swapped in (:mod:`.converter_scope`), which spares a second interpreter and its imports (torch among them), or in a
subprocess where that is not possible."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..errors import OptionError, UserInputError
from ..files import write_text
from ..vocabulary import named
from . import converter_scope

ENV_VAR = "MOECOMPRESS_LLAMA_CPP"
CONVERTER = "convert_hf_to_gguf.py"
DRIVER = Path(__file__).with_name("convert_driver.py")


def find_converter(option: str | os.PathLike[str] | None) -> Path:
    """The directory holding ``convert_hf_to_gguf.py`` (and its ``gguf-py``), from ``--llama-cpp`` or the
    environment: a llama.cpp checkout, or an unpacked llama-cpp-python sdist (``vendor/llama.cpp``)."""
    given = option if option is not None else os.environ.get(ENV_VAR)
    if not given:
        raise OptionError(
            f"no llama.cpp converter: pass {named('llama_cpp', 'DIR')} (a llama.cpp checkout or an unpacked "
            f"llama-cpp-python sdist) or set {ENV_VAR}"
        )
    root = Path(given).expanduser()
    for candidate in (root, root / "vendor" / "llama.cpp"):
        if (candidate / CONVERTER).is_file() and (candidate / "gguf-py").is_dir():
            return candidate.resolve()
    raise UserInputError(f"{root}: no {CONVERTER} with its gguf-py there or under vendor/llama.cpp")


def gpt2_compatible(tokenizer_json: Path) -> bool:
    """Whether a tokenizer is a byte-level BPE whose only pre-tokenisation is GPT-2's regex (``ByteLevel`` with
    ``use_regex``, no prefix space, no normaliser): llama.cpp's ``gpt-2`` pre-tokenizer splits text the same."""
    try:
        data = json.loads(tokenizer_json.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    pre = data.get("pre_tokenizer") or {}
    return (
        (data.get("model") or {}).get("type") == "BPE"
        and data.get("normalizer") is None
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space", False)
    )


def fallback_pre_tokenizer(model_dir: Path) -> str | None:
    return "gpt-2" if gpt2_compatible(model_dir / "tokenizer.json") else None


def run_converter(
    llama_cpp: Path,
    model_dir: Path,
    outfile: Path,
    *,
    outtype: str = "bf16",
    holes: dict[str, tuple[str, tuple[int, ...]]] | None = None,
    file_type: str | None = None,
    in_process: bool = True,
) -> dict[str, Any]:
    """Convert ``model_dir`` to ``outfile``; returns what the hooks did. The tensors named in ``holes`` (name ->
    GGML type name and the blocks' byte shape) are left unwritten in ``outfile``, for the caller to fill. The
    converter's own error output ends up in a one-line :class:`UserInputError` (its last line) when it fails.
    ``in_process``: in this process where :mod:`.converter_scope` can (a single thread, modules that import here),
    else in a subprocess."""
    spec = {
        "llama_cpp": str(llama_cpp),
        "pre_tokenizer": fallback_pre_tokenizer(model_dir),
        "holes": {name: [kind, list(shape)] for name, (kind, shape) in (holes or {}).items()},
        "file_type": file_type,
    }
    args = [str(Path(model_dir).absolute()), "--outfile", str(Path(outfile).absolute()), "--outtype", outtype]
    if in_process and converter_scope.usable():
        try:
            return converter_scope.run(llama_cpp, spec, args)
        except converter_scope.ImportFailed:
            pass
        except RuntimeError as error:
            raise UserInputError(f"llama.cpp's converter failed on {model_dir}: {error}") from None
    return _run_subprocess(spec, args, model_dir)


def _run_subprocess(spec: dict[str, Any], args: list[str], model_dir: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="moecompress-convert-") as work:
        spec_path, result_path = Path(work) / "spec.json", Path(work) / "result.json"
        write_text(spec_path, json.dumps({**spec, "result": str(result_path)}))
        # The converter runs in ``work``: relative paths would name places there.
        command = [sys.executable, str(DRIVER), str(spec_path), "--", *args]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=work)
        if done.returncode != 0 or not result_path.is_file():
            lines = [line for line in (done.stderr + done.stdout).strip().splitlines() if line.strip()]
            last = lines[-1].strip() if lines else f"exit code {done.returncode}"
            raise UserInputError(f"llama.cpp's converter failed on {model_dir}: {last}")
        return json.loads(result_path.read_text())
