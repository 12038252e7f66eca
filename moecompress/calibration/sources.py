"""Calibration and evaluation sources, addressed by one string.

- ``builtin:prose`` / ``builtin:code`` (optionally ``:calib``, ``:heldout`` or ``:all``): the built-in corpus.
- a path to a ``.txt`` file (one document), a ``.jsonl`` file (one JSON object a line, its ``text`` field), or a
  ``.parquet`` file (its ``text`` column); a directory of such files.
- ``hf:NAME[:CONFIG][:SPLIT]``: a Hugging Face dataset through ``datasets.load_dataset`` (its ``text`` column).
  A single suffix is a split when it names one (``train``, ``validation``, ``test`` or a slice like
  ``train[:1000]``), else a config.
Several sources join with commas: ``builtin:prose,builtin:code``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import UserInputError
from .builtin_corpus import BUILTIN_NAMES, builtin_documents
from .documents import Document

PARTS = ("calib", "heldout", "all")
DATA_SUFFIXES = (".txt", ".jsonl", ".parquet")
PARQUET_MAGIC = b"PAR1"
_SPLIT = re.compile(r"^(train|validation|valid|test|dev)(\[.*\])?$")


def load_documents(spec: str, *, default_part: str = "calib", text_field: str = "text") -> list[Document]:
    """Documents of every source named in ``spec``; ``default_part`` picks the built-in corpus's part."""
    documents: list[Document] = []
    for one in (piece.strip() for piece in spec.split(",")):
        if not one:
            continue
        documents.extend(_load_one(one, default_part, text_field))
    if not documents:
        raise UserInputError(f"{spec}: the data source holds no documents")
    return documents


def _load_one(spec: str, default_part: str, text_field: str) -> list[Document]:
    if spec.startswith("builtin:"):
        pieces = spec.split(":")
        name = pieces[1]
        part = pieces[2] if len(pieces) > 2 else default_part
        if name not in BUILTIN_NAMES or part not in PARTS or len(pieces) > 3:
            raise UserInputError(
                f"{spec}: unknown built-in source; use builtin:{{{','.join(BUILTIN_NAMES)}}}[:{{{','.join(PARTS)}}}]"
            )
        return builtin_documents(name, part)  # type: ignore[arg-type]
    if spec.startswith("hf:"):
        return _hf_documents(spec, text_field)
    path = Path(spec).expanduser()
    if path.is_dir():
        files = _data_files(path)
        if not files:
            raise UserInputError(f"{spec}: directory has no .txt, .jsonl or .parquet files")
        return [doc for file in files for doc in _file_documents(file, text_field)]
    if path.is_file():
        return _file_documents(path, text_field)
    raise UserInputError(f"{spec}: no such data file, and not builtin:NAME or hf:NAME")


def _data_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.suffix in DATA_SUFFIXES and p.is_file())


def check_data_files(path: Path) -> None:
    """The local data file ``path`` (or every data file under the directory ``path``) is of a type the loader reads,
    and each ``.parquet`` file carries parquet's magic bytes at both ends; a few bytes a file, so a mislabelled or
    truncated file is refused before any work, not when calibration reads it."""
    if path.is_dir():
        files = _data_files(path)
        if not files:
            raise UserInputError(f"{path}: directory has no .txt, .jsonl or .parquet files")
    elif path.suffix not in DATA_SUFFIXES:
        raise UserInputError(f"{path}: unsupported data file type {path.suffix!r} (use .txt, .jsonl or .parquet)")
    else:
        files = [path]
    for file in files:
        if file.suffix == ".parquet":
            check_parquet_magic(file)


def check_parquet_magic(path: Path) -> None:
    with open(path, "rb") as handle:
        head = handle.read(4)
        size = handle.seek(0, 2)
        handle.seek(max(size - 4, 0))
        tail = handle.read(4)
    if size < 12 or head != PARQUET_MAGIC or tail != PARQUET_MAGIC:
        where = "start" if head != PARQUET_MAGIC else "end"
        raise UserInputError(f"{path}: not a parquet file (no PAR1 magic at its {where}: truncated, or another format)")


def read_text(path: Path) -> str:
    """``path`` decoded as UTF-8; bytes that are not UTF-8 become U+FFFD, with a warning saying how many."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        text = data.decode("utf-8", errors="replace")
        replaced = text.count("\ufffd") - data.count("\ufffd".encode())
        from ..progress import warn

        warn(
            f"{path} is not valid UTF-8 (first bad byte at offset {error.start}); {replaced} undecodable "
            "byte sequence(s) were replaced by U+FFFD"
        )
        return text


def _file_documents(path: Path, text_field: str) -> list[Document]:
    tag = path.stem
    if path.suffix == ".txt":
        return [Document(text=read_text(path), tag=tag, id=str(path))]
    if path.suffix == ".jsonl":
        documents = []
        for number, line in enumerate(re.split(r"\r\n|\r|\n", read_text(path)), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise UserInputError(f"{path}:{number}: invalid JSON ({error.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise UserInputError(f"{path}:{number}: no string field {text_field!r}")
            documents.append(Document(text=record[text_field], tag=str(record.get("tag", tag)), id=f"{path}:{number}"))
        return documents
    if path.suffix == ".parquet":
        import pyarrow
        import pyarrow.parquet as pq

        check_parquet_magic(path)
        try:
            table = pq.read_table(path)
        except (pyarrow.ArrowException, OSError) as error:
            raise UserInputError(f"{path}: unreadable parquet file ({str(error).splitlines()[0]})") from None
        if text_field not in table.column_names:
            raise UserInputError(f"{path}: no column {text_field!r} (columns: {', '.join(table.column_names)})")
        texts = table.column(text_field).to_pylist()
        return [Document(text=t, tag=tag, id=f"{path}:{i}") for i, t in enumerate(texts) if isinstance(t, str)]
    raise UserInputError(f"{path}: unsupported data file type {path.suffix!r} (use .txt, .jsonl or .parquet)")


def parse_hf_spec(spec: str) -> tuple[str, str | None, str]:
    """``hf:NAME[:CONFIG][:SPLIT]`` → (name, config, split)."""
    pieces = re.split(r":(?![^\[]*\])", spec[len("hf:") :])
    name, config, split = pieces[0], None, "train"
    if not name:
        raise UserInputError(f"{spec}: hf: needs a dataset name")
    if len(pieces) == 2:
        if _SPLIT.match(pieces[1]):
            split = pieces[1]
        else:
            config = pieces[1]
    elif len(pieces) == 3:
        config, split = pieces[1] or None, pieces[2]
    elif len(pieces) > 3:
        raise UserInputError(f"{spec}: use hf:NAME[:CONFIG][:SPLIT]")
    return name, config, split


def _hf_documents(spec: str, text_field: str) -> list[Document]:
    import datasets

    name, config, split = parse_hf_spec(spec)
    try:
        dataset = datasets.load_dataset(name, config, split=split)
    except Exception as error:  # datasets raises many types for a missing or unreachable dataset
        raise UserInputError(
            f"{spec}: could not load dataset ({type(error).__name__}: {str(error).splitlines()[0]})"
        ) from None
    if text_field not in dataset.column_names:
        raise UserInputError(f"{spec}: no column {text_field!r} (columns: {', '.join(dataset.column_names)})")
    return [
        Document(text=text, tag=name, id=f"{name}:{i}")
        for i, text in enumerate(dataset[text_field])
        if isinstance(text, str) and text
    ]
