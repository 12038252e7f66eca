"""Checks made when a checkpoint, a data file or a hub id is read (issue 40): safetensors headers that do not tile
their data, config.json against the stored shapes, NaN refused at the read that finds it with the tensor named,
and hub ids that fail at once offline. The command-line refusals are cases of scripts/bad_input_table.py."""

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moecompress.calibration.sources import check_data_files, load_documents
from moecompress.checkpoint import CheckpointReader, resolve_model
from moecompress.checkpoint.consistency import check_against_config, check_header
from moecompress.errors import UserInputError
from moecompress.families import adapter_for
from moecompress.loading import load_adapter, load_model, load_tokenizer


def _entry(begin: int, end: int, dtype: str = "BF16", shape: list | None = None) -> dict:
    return {"dtype": dtype, "shape": [(end - begin) // 2] if shape is None else shape, "data_offsets": [begin, end]}


def test_a_header_that_tiles_its_data_passes():
    check_header(
        Path("x"), {"__metadata__": {"format": "pt"}, "a": _entry(0, 8), "b": _entry(8, 8), "c": _entry(8, 12)}, 12
    )


@pytest.mark.parametrize(
    ("header", "data_len", "message"),
    [
        ({"a": _entry(0, 8), "b": _entry(4, 12)}, 12, "'b' (bytes 4-12) overlaps 'a'"),
        ({"a": _entry(0, 4), "b": _entry(8, 12)}, 12, "bytes 4-8 of the data belong to no tensor"),
        ({"a": _entry(0, 8)}, 12, "4 bytes after the last tensor's data"),
        ({"a": _entry(0, 16)}, 12, "outside the 12 data bytes"),
        ({"a": _entry(8, 4, shape=[0])}, 12, "outside the 12 data bytes"),
        ({"a": _entry(0, 12, shape=[2, 2])}, 12, "BF16 [2, 2] is 8 bytes, its data_offsets span 12"),
        ({"a": _entry(0, 12, dtype="F32", shape=[2])}, 12, "F32 [2] is 8 bytes"),
        ({"a": _entry(0, 12, shape=[-6])}, 12, "not a list of whole numbers"),
        ({"a": {"dtype": "BF16", "shape": [6], "data_offsets": [0]}}, 12, "not two whole numbers"),
        ({"a": [0, 12]}, 12, "is an array, not an object"),
        ([1, 2], 12, "not an object"),
    ],
)
def test_a_header_that_does_not_tile_its_data_is_refused(header, data_len, message):
    with pytest.raises(UserInputError, match="corrupt safetensors") as error:
        check_header(Path("x"), header, data_len)
    assert message in str(error.value)


def test_every_supported_family_passes_the_config_checks(tiny_checkpoints):
    """No false refusal: each family's tiny checkpoint (its release layout: fused experts, MTP modules, vision
    towers) agrees with its config as the checks read them, and a changed hidden size is caught in each."""
    for family, directory in tiny_checkpoints.items():
        adapter = load_adapter(directory)
        with CheckpointReader(directory, decode=False) as reader:
            check_against_config(adapter, reader.tensors, family)
            config = json.loads(json.dumps(reader.config))
            text = config.get("thinker_config", config)
            text = text.get("text_config", text)
            key = "hidden_size" if "hidden_size" in text else "d_model"
            text[key] = int(text[key]) * 2
            with pytest.raises(UserInputError, match="hidden_size"):
                check_against_config(adapter_for(config), reader.tensors, family)


def _copy_with_nan(tmp_path: Path, key: str) -> Path:
    """tiny-moe with a NaN as the first value of ``key``."""
    model = tmp_path / "nan"
    shutil.copytree(resolve_model("builtin:tiny-moe"), model)
    shard = model / "model.safetensors"
    raw = bytearray(shard.read_bytes())
    (length,) = struct.unpack("<Q", raw[:8])
    begin = 8 + length + json.loads(raw[8 : 8 + length])[key]["data_offsets"][0]
    raw[begin : begin + 2] = torch.tensor([float("nan")], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    shard.write_bytes(bytes(raw))
    return model


def test_nan_is_refused_by_the_read_of_its_layer_naming_the_tensor(tmp_path):
    key = "model.layers.2.mlp.experts.5.up_proj.weight"
    model = _copy_with_nan(tmp_path, key)
    with CheckpointReader(model) as reader:
        reader.read([k for k in reader.keys() if k.startswith("model.layers.1.")])
        with pytest.raises(UserInputError) as error:
            reader.read([k for k in reader.keys() if k.startswith("model.layers.2.")])
    assert str(error.value) == f"{model / 'model.safetensors'}: tensor {key!r} holds NaN or Inf values"


def test_nan_is_refused_when_a_whole_model_is_loaded(tmp_path):
    """prune-heads, qat and the whole-model evaluation load with from_pretrained, which checks nothing: the load
    itself refuses, instead of head gates training to their end on NaN."""
    key = "model.layers.3.self_attn.o_proj.weight"
    model = _copy_with_nan(tmp_path, key)
    with pytest.raises(UserInputError) as error:
        load_model(model, load_adapter(model))
    assert str(error.value) == f"{model}: weight {key!r} holds NaN or Inf values"


def test_a_model_without_tokenizer_files_is_refused_as_such(tmp_path):
    model = tmp_path / "m"
    shutil.copytree(resolve_model("builtin:tiny-moe"), model)
    assert len(load_tokenizer(model)("one two three")["input_ids"]) > 0
    (model / "tokenizer.json").unlink()
    with pytest.raises(UserInputError, match="no tokenizer"):
        load_tokenizer(model)


def test_parquet_files_are_recognised_by_their_magic(tmp_path):
    import pyarrow
    import pyarrow.parquet as pq

    good = tmp_path / "good.parquet"
    pq.write_table(pyarrow.table({"text": ["first document", "second one"]}), good)
    check_data_files(good)
    assert [d.text for d in load_documents(str(good))] == ["first document", "second one"]
    for name, data in (("renamed.parquet", b"text\nhello\n"), ("cut.parquet", good.read_bytes()[:-1])):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(UserInputError, match="not a parquet file"):
            check_data_files(tmp_path / name)
        with pytest.raises(UserInputError, match="not a parquet file"):
            load_documents(str(tmp_path / name))


_RESOLVE_TIMED = """
import sys, time
from moecompress.checkpoint import resolve_model
from moecompress.errors import UserInputError
import huggingface_hub.hf_api
start = time.perf_counter()
try:
    print(resolve_model(sys.argv[1]))
except UserInputError as error:
    print("refused:", error)
print(f"{time.perf_counter() - start:.3f}")
"""


def _resolve_in_child(repo_id: str, cache: Path, **env: str) -> tuple[str, float]:
    """``resolve_model(repo_id)`` in a fresh interpreter (huggingface_hub reads its settings at import): the one
    line it printed, and the seconds the call took (imports excluded)."""
    environment = {**os.environ, "HF_HUB_CACHE": str(cache), **env}
    done = subprocess.run(
        [sys.executable, "-c", _RESOLVE_TIMED, repo_id], capture_output=True, text=True, env=environment, timeout=300
    )
    assert done.returncode == 0, done.stderr
    line, seconds = done.stdout.strip().splitlines()
    return line, float(seconds)


@pytest.mark.parametrize(
    "env",
    [{"HF_HUB_OFFLINE": "1"}, {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}],
    ids=["offline", "unreachable"],
)
def test_an_uncached_hub_id_fails_at_once_without_network(tmp_path, env):
    """huggingface_hub retried the first request for 23-56 s; now one short request (none offline) decides."""
    line, seconds = _resolve_in_child("no-such-org/no-such-model", tmp_path / "hub", **env)
    assert line.startswith(
        "refused: no-such-org/no-such-model: not a local directory, and not in the Hugging Face cache"
    )
    assert ("HF_HUB_OFFLINE is set" if env["HF_HUB_OFFLINE"] == "1" else "the Hub cannot be reached") in line
    assert seconds < 5, seconds


def test_a_cached_hub_id_resolves_when_the_hub_cannot_be_reached(tmp_path):
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--tiny-org--tiny-moe"
    shutil.copytree(resolve_model("builtin:tiny-moe"), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    line, seconds = _resolve_in_child("tiny-org/tiny-moe", cache, HF_HUB_OFFLINE="0", HF_ENDPOINT="http://127.0.0.1:9")
    assert line == str(repo / "snapshots" / commit) and seconds < 5, (line, seconds)


def test_a_repository_the_hub_does_not_have_is_refused_after_one_request(tmp_path):
    """A Hub that answers (a local server standing in for it) and says 404 RepoNotFound: one request, one line."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    paths = []

    class NotFound(BaseHTTPRequestHandler):
        def do_GET(self):
            paths.append(self.path)
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_HEAD = do_GET

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        line, seconds = _resolve_in_child(
            "no-such-org/no-such-model", tmp_path / "hub", HF_HUB_OFFLINE="0", HF_ENDPOINT=endpoint
        )
    finally:
        server.shutdown()
    assert line == "refused: no-such-org/no-such-model: no such local directory or Hub repository", line
    # (huggingface_hub also GETs /api/agent-harnesses by itself, which is no request for the model)
    asked = [path.split("?")[0] for path in paths if "no-such" in path]
    assert asked == ["/api/models/no-such-org/no-such-model"] and seconds < 5, (asked, seconds)
