"""The built-in corpus: text every Python install carries, so calibration needs no download.

``prose`` is the stdlib's ``pydoc_data.topics`` (the language reference's prose, 79 topics); ``code`` is the
stdlib's top-level ``*.py`` modules. Each is split by document into a calibration part and a held-out part with a
fixed hash of the document's id, so the split is the same on every machine with the same Python version.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from typing import Literal

from .documents import Document

BUILTIN_NAMES = ("prose", "code")
Part = Literal["calib", "heldout", "all"]
HELDOUT_PERCENT = 12


def _is_heldout(doc_id: str) -> bool:
    return zlib.crc32(doc_id.encode()) % 100 < HELDOUT_PERCENT


def _prose_documents() -> list[Document]:
    from pydoc_data.topics import topics

    return [Document(text=topics[name], tag="prose", id=f"prose/{name}") for name in sorted(topics)]


def _code_documents() -> list[Document]:
    stdlib = sysconfig.get_paths()["stdlib"]
    documents = []
    for filename in sorted(os.listdir(stdlib)):
        if not filename.endswith(".py"):
            continue
        with open(os.path.join(stdlib, filename), encoding="utf-8", errors="replace") as handle:
            documents.append(Document(text=handle.read(), tag="code", id=f"code/{filename}"))
    return documents


def builtin_documents(name: str, part: Part = "all") -> list[Document]:
    """Documents of the built-in source ``name`` (``prose`` or ``code``), restricted to ``part``."""
    if name == "prose":
        documents = _prose_documents()
    elif name == "code":
        documents = _code_documents()
    else:
        raise ValueError(f"unknown built-in source {name!r}; choose from {', '.join(BUILTIN_NAMES)}")
    if part == "all":
        return documents
    want_heldout = part == "heldout"
    return [doc for doc in documents if _is_heldout(doc.id) == want_heldout]
