"""What the user has allowed to execute: remote modelling code and pickle deserialisation are both off unless asked
for (the CLI's ``--trust-remote-code`` and ``--allow-pickle``; in Python, :func:`trusting`).

Even when pickle is allowed, weights are read with ``torch.load(weights_only=True)``, which unpickles tensors and
plain containers only and refuses any other object.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class Trust:
    remote_code: bool = False
    pickle: bool = False


CURRENT = Trust()


@contextlib.contextmanager
def trusting(*, remote_code: bool = False, pickle: bool = False) -> Iterator[Trust]:
    """Allow remote code and/or pickle weights inside the block."""
    saved = Trust(CURRENT.remote_code, CURRENT.pickle)
    CURRENT.remote_code, CURRENT.pickle = remote_code, pickle
    try:
        yield CURRENT
    finally:
        CURRENT.remote_code, CURRENT.pickle = saved.remote_code, saved.pickle
