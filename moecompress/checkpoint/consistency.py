"""Checks that a checkpoint agrees with itself and with its config.json, made when it is opened.

Only config.json and the safetensors headers are read (no tensor data), so the checks cost milliseconds on a
checkpoint of any size and a file that disagrees is refused in one line before any work, instead of as a
transformers size mismatch, a traceback, or a silently wrong layer count half-way through a run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import UserInputError

MAX_HEADER_BYTES = 100_000_000
"""The safetensors format's own limit on a header's size."""

DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
}
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}

_WHOLE_NUMBER_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_experts_per_tok",
    "head_dim",
    "max_position_embeddings",
    "intermediate_size",
)
_NUMBER_OR_LIST_FIELDS = ("moe_intermediate_size", "num_experts", "num_local_experts", "n_routed_experts")
"""Fields some releases give per layer (Hunyuan's expert sizes)."""
_MTP_COUNT_KEYS = ("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers")


# ---- config.json ----------------------------------------------------------------------------------------------
def check_config_types(config: Any, path: Path) -> dict[str, Any]:
    """``config`` (parsed config.json) is an object whose size fields are whole numbers and whose sections are
    objects; returned as it is."""
    if not isinstance(config, dict):
        raise UserInputError(f"{path}: must hold a JSON object, not {_json_type(config)}")
    sections = [("", config)]
    for name in ("text_config", "quantization_config"):
        if name in config and config[name] is not None:
            if not isinstance(config[name], dict):
                raise UserInputError(f"{path}: {name} must be an object, not {_json_type(config[name])}")
            sections.append((f"{name}.", config[name]))
    if "model_type" in config and not isinstance(config["model_type"], str):
        raise UserInputError(f"{path}: model_type must be a string, not {_json_type(config['model_type'])}")
    for prefix, section in sections:
        for field in (*_WHOLE_NUMBER_FIELDS, *_NUMBER_OR_LIST_FIELDS):
            value = section.get(field)
            if value is None or _whole(value):
                continue
            if field in _NUMBER_OR_LIST_FIELDS and isinstance(value, list) and all(_whole(v) for v in value):
                continue
            raise UserInputError(
                f"{path}: {prefix}{field} is {_json_type(value)} {_short(value)}, expected a non-negative whole number"
            )
    return config


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", float: "a number"}
    if value is None:
        return "null"
    if isinstance(value, int) and not isinstance(value, bool):
        return "a number"
    return names.get(type(value), type(value).__name__)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ---- safetensors headers ----------------------------------------------------------------------------------------
def check_header(path: Path, header: Any, data_len: int) -> None:
    """A safetensors header describes its data section exactly: every entry has a dtype, a shape of whole numbers
    and two offsets inside the data; each tensor's byte count is its shape times its dtype's size; and the
    tensors tile the data section (no overlap, no hole, nothing after the last), as the format requires."""
    if not isinstance(header, dict):
        raise UserInputError(f"{path}: corrupt safetensors header (a JSON {_json_type(header)}, not an object)")
    spans = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        spans.append((*_entry_span(path, key, entry, data_len), key))
    spans.sort()
    end, previous = 0, None
    for begin, stop, key in spans:
        if begin < end:
            raise UserInputError(
                f"{path}: corrupt safetensors header: tensor {key!r} (bytes {begin}-{stop}) overlaps {previous!r}"
            )
        if begin > end:
            raise UserInputError(
                f"{path}: corrupt safetensors header: bytes {end}-{begin} of the data belong to no tensor"
            )
        end, previous = stop, key
    if end != data_len:
        raise UserInputError(
            f"{path}: corrupt safetensors file: {data_len - end} bytes after the last tensor's data (the header "
            f"covers {end} of {data_len})"
        )


def _entry_span(path: Path, key: str, entry: Any, data_len: int) -> tuple[int, int]:
    """``entry``'s byte range, checked (``type(x) is int`` rather than ``_whole``: this runs once per tensor of
    checkpoints with 100,000 of them)."""
    where = f"{path}: corrupt safetensors header: tensor {key!r}"
    if type(entry) is not dict:
        raise UserInputError(f"{where} is {_json_type(entry)}, not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if type(dtype) is not str:
        raise UserInputError(f"{where} has no dtype")
    count = 1
    for dim in shape if type(shape) is list else (None,):
        if type(dim) is not int or dim < 0:
            raise UserInputError(f"{where} has shape {_short(shape)}, not a list of whole numbers")
        count *= dim
    if type(offsets) is not list or len(offsets) != 2 or not all(type(o) is int and o >= 0 for o in offsets):
        raise UserInputError(f"{where} has data_offsets {_short(offsets)}, not two whole numbers")
    begin, stop = offsets
    if begin > stop or stop > data_len:
        raise UserInputError(f"{where} has data_offsets [{begin}, {stop}] outside the {data_len} data bytes")
    size = DTYPE_BYTES.get(dtype)
    if size is not None and count * size != stop - begin:
        raise UserInputError(f"{where}: {dtype} {shape} is {count * size} bytes, its data_offsets span {stop - begin}")
    return begin, stop


# ---- config.json against the weights -----------------------------------------------------------------------------
def check_against_config(adapter: Any, tensors: dict[str, Any], source: str) -> None:
    """The sizes config.json declares (hidden size, vocabulary, layer count, experts per layer, expert widths)
    agree with the stored tensors' shapes, as their headers give them. Tensors that are not plain floating-point
    weights (packed codes of a quantised output) are not compared."""
    text = adapter.text_config
    hidden = text.get("hidden_size")
    vocab = text.get("vocab_size", adapter.config.get("vocab_size"))
    _check_embeddings(adapter, tensors, source, hidden, vocab)
    _check_layer_count(adapter, tensors, source)
    for layer in adapter.moe_layers():
        _check_moe_layer(adapter, tensors, source, layer, hidden)


def _plain(info: Any) -> bool:
    return info is not None and info.dtype in _FLOAT_DTYPES and len(info.shape) >= 2


def _check_embeddings(adapter: Any, tensors: dict[str, Any], source: str, hidden: Any, vocab: Any) -> None:
    for key, info in tensors.items():
        if not any(_embedding_or_head(name) for name in {key, adapter.runtime_module_name(key)}):
            continue
        outside_layers = adapter.layer_of_key(key) is None and not adapter.is_vision_key(key)
        if not (outside_layers and not key.startswith("mtp.") and _plain(info)):
            continue
        rows, width = info.shape[0], info.shape[-1]
        if isinstance(hidden, int) and width != hidden:
            raise UserInputError(
                f"{source}: config.json says hidden_size {hidden}, the weights' {key} is {list(info.shape)}"
            )
        if isinstance(vocab, int) and rows != vocab:
            raise UserInputError(f"{source}: config.json says vocab_size {vocab}, the weights' {key} has {rows} rows")


def _embedding_or_head(name: str) -> bool:
    """The input embedding or the output head, under transformers' names or the native ones some releases keep
    (``tok_embeddings``)."""
    heads = name == "lm_head.weight" or name.endswith(".lm_head.weight")
    return heads or name.endswith(("embed_tokens.weight", "tok_embeddings.weight"))


def _check_layer_count(adapter: Any, tensors: dict[str, Any], source: str) -> None:
    layers = {adapter.layer_of_key(key) for key in tensors if not adapter.is_vision_key(key)} - {None}
    declared = adapter.num_layers
    missing = sorted(set(range(declared)) - layers)
    if missing:
        found = f"{len(layers & set(range(declared)))} of them" if layers else "none"
        raise UserInputError(
            f"{source}: config.json says num_hidden_layers {declared}, the weights hold {found} (no tensors of "
            f"layer {missing[0]})"
        )
    text = adapter.text_config
    extra = next((text[key] for key in _MTP_COUNT_KEYS if isinstance(text.get(key), int)), 0)
    beyond = sorted(layer for layer in layers if layer >= declared + extra)
    if beyond:
        raise UserInputError(
            f"{source}: config.json says num_hidden_layers {declared}, the weights hold tensors of layer {beyond[-1]}"
        )


def _check_moe_layer(adapter: Any, tensors: dict[str, Any], source: str, layer: int, hidden: Any) -> None:
    promised = adapter.experts_in_layer(layer)
    if adapter.top_k > promised:
        raise UserInputError(
            f"{source}: config.json routes each token to {adapter.top_k} experts, more than the {promised} of layer "
            f"{layer} (the router's top-k cannot choose them)"
        )
    router_key = adapter._router_key(layer, "weight")
    router = tensors.get(router_key)
    columns = adapter.stored_router_columns(layer)
    rows = router.shape[-1 if adapter.router_transposed else 0] if _plain(router) else None
    if rows is not None and rows != columns:
        raise UserInputError(
            f"{source}: layer {layer} ({router_key}): config.json says {columns} experts, weights hold {rows}"
        )
    fused = tensors.get(adapter._fused_key(layer, "gate_up_proj"))
    if _plain(fused) and len(fused.shape) == 3 and fused.shape[0] != promised:
        raise UserInputError(
            f"{source}: layer {layer}: config.json says {promised} experts, "
            f"{adapter._fused_key(layer, 'gate_up_proj')} holds {fused.shape[0]}"
        )
    first = [tensors.get(adapter._expert_key(layer, 0, which)) for which in range(3)]
    if not all(_plain(info) and len(info.shape) == 2 for info in first):
        return
    count = 0
    while adapter._expert_key(layer, count, 0) in tensors:
        count += 1
    if count != promised:
        raise UserInputError(
            f"{source}: layer {layer}: config.json says {promised} experts, the weights hold {count} "
            f"({adapter._expert_key(layer, 0, 0)} and on)"
        )
    gate, up, down = (info.shape for info in first)
    width = gate[0]
    if isinstance(hidden, int) and (gate[1], up[1], down[0]) != (hidden, hidden, hidden):
        raise UserInputError(
            f"{source}: layer {layer}: config.json says hidden_size {hidden}, expert 0's weights are "
            f"{list(gate)}, {list(up)}, {list(down)}"
        )
    if (up[0], down[1]) != (width, width):
        raise UserInputError(
            f"{source}: layer {layer}: expert 0's gate, up and down widths disagree ({list(gate)}, {list(up)}, "
            f"{list(down)})"
        )
    declared = adapter.first_expert_width(layer)
    if declared is not None and declared != width:
        raise UserInputError(
            f"{source}: layer {layer}: config.json says expert width {declared}, expert 0's weights are {width} wide"
        )
