"""Runs llama.cpp's ``convert_hf_to_gguf.py`` unmodified, with the ``gguf`` package its checkout ships (which may
differ from ours): in its own process, or in ours with its modules swapped in (:mod:`.converter_scope`). Three hooks:

- a BPE pre-tokenizer the converter's hash table does not know is written as the compatible type we name
  (only when the converter itself finds none);
- the expert tensors we name are written as GGML blocks of the type and byte shape we give (their logical shape
  must agree with the converter's), but their bytes are left a hole: the caller writes our blocks there
  afterwards (the converter never computes its own data for them: it loads tensors lazily); where each hole
  starts in the output file is noted as the writer reaches it;
- ``general.file_type`` is set to the type we name.

Usage: ``python convert_driver.py SPEC.json -- CONVERTER ARGS``. SPEC: ``llama_cpp`` (the directory holding
``convert_hf_to_gguf.py``), ``pre_tokenizer`` (or null), ``holes`` (tensor name -> [GGML type name, byte shape]),
``file_type`` (LlamaFileType name or null), ``result`` (a JSON path written at the end). The result:
``pre_tokenizer_fallback``, ``substituted`` (the holes' names) and ``hole_offsets`` (name -> byte offset, for the
holes written straight into ``--outfile``). This file imports nothing from moecompress.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np


class Hole:
    """Stands for a tensor's raw bytes in the converter's writer: as many bytes skipped (the last one written, so
    that the file reaches its full length) in place of data."""

    dtype = np.dtype(np.uint8)

    def __init__(self, name, shape, written):
        self.name, self.shape, self.written = name, tuple(shape), written
        self.nbytes = int(np.prod(self.shape))

    def tofile(self, handle):
        self.written[self.name] = (getattr(handle, "name", None), handle.tell())
        if self.nbytes:
            handle.seek(self.nbytes - 1, os.SEEK_CUR)
            handle.write(b"\0")


def convert(spec: dict, args: list[str]) -> dict:
    """Runs the converter on ``args`` with the hooks of ``spec``; returns the result. The converter's directory and
    its ``gguf-py`` must come first on ``sys.path``."""
    import convert_hf_to_gguf
    import gguf  # the converter's own copy
    from conversion import base

    used = {"pre_tokenizer_fallback": None, "substituted": []}
    pre = spec.get("pre_tokenizer")
    original_pre = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):
        try:
            return original_pre(self, tokenizer)
        except NotImplementedError:
            if pre is None:
                raise
            used["pre_tokenizer_fallback"] = pre
            return pre

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre

    holes = spec.get("holes", {})
    pending = set(holes)
    written = {}
    original_add_tensor = gguf.GGUFWriter.add_tensor

    def add_tensor(self, name, tensor, raw_shape=None, raw_dtype=None, tensor_endianess=None):
        if name in pending:
            pending.discard(name)
            type_name, shape = holes[name]
            qtype = gguf.GGMLQuantizationType[type_name]
            ours = Hole(name, shape, written)
            theirs = tuple(raw_shape) if raw_shape is not None else tuple(tensor.shape)
            if raw_dtype is not None and tensor.dtype.itemsize == 1 and raw_shape is None:
                theirs = gguf.quant_shape_from_byte_shape(theirs, raw_dtype)
            logical = gguf.quant_shape_from_byte_shape(ours.shape, qtype)
            if tuple(logical) != tuple(theirs):
                raise ValueError(f"{name}: the converter's shape {theirs} differs from the substitute's {logical}")
            used["substituted"].append(name)
            return original_add_tensor(self, name, ours, raw_dtype=qtype, tensor_endianess=tensor_endianess)
        return original_add_tensor(self, name, tensor, raw_shape, raw_dtype, tensor_endianess)

    gguf.GGUFWriter.add_tensor = add_tensor

    file_type = spec.get("file_type")
    if file_type:
        original_file_type = gguf.GGUFWriter.add_file_type

        def add_file_type(self, ftype):
            return original_file_type(self, int(gguf.LlamaFileType[file_type]))

        gguf.GGUFWriter.add_file_type = add_file_type

    sys.argv = ["convert_hf_to_gguf.py", *args]
    convert_hf_to_gguf.main()
    if pending:
        raise ValueError(f"the converter wrote no tensor named {sorted(pending)[0]!r} ({len(pending)} left)")
    outfile = Path(args[args.index("--outfile") + 1]).resolve()
    used["hole_offsets"] = {
        name: offset
        for name, (path, offset) in written.items()
        if isinstance(path, str) and Path(path).resolve() == outfile
    }
    return used


def main(argv: list[str]) -> None:
    split = argv.index("--")
    spec = json.loads(Path(argv[split - 1]).read_text())
    root = Path(spec["llama_cpp"])
    sys.path.insert(0, str(root))
    sys.path.insert(1, str(root / "gguf-py"))
    used = convert(spec, argv[split + 1 :])
    Path(spec["result"]).write_text(json.dumps(used))


if __name__ == "__main__":
    main(sys.argv[1:])
