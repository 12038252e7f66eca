"""The compute device of a run (``--device``, a recipe's ``device:``, the Python API's ``device=``).

A run sets it once (:func:`using_device`); the sweeps and the passes' math ask :func:`compute_device` where to put a
materialised layer, a calibration batch and the tensors they create. Checkpoints are read to the host and written
from it; hidden states between layers stay on the host (pinned when the device is CUDA) and move per batch.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator

import torch

from .defaults import DEVICE_CHOICES
from .errors import UserInputError

HOST = torch.device("cpu")

_current: torch.device = HOST


def parse_device(spec: str | torch.device | None, where: str = "device") -> torch.device:
    """``auto`` (CUDA when torch sees one, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``; anything else, or CUDA
    where torch sees none, is a :class:`UserInputError` naming ``where``, the option as its caller spells it."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    text = "auto" if spec is None else str(spec).strip().lower()
    if text == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else HOST
    if text == "cpu":
        return HOST
    match = re.fullmatch(r"cuda(?::(\d+))?", text)
    if match is None:
        raise UserInputError(f"{where}: {spec!r} is not a device; use {DEVICE_CHOICES}")
    if not torch.cuda.is_available():
        raise UserInputError(f"{where}: {spec!r} asked for, but torch sees no CUDA device (use cpu or auto)")
    index = int(match.group(1) or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise UserInputError(f"{where}: {spec!r} asked for, but torch sees {count} CUDA device(s)")
    return torch.device("cuda", index)


def compute_device() -> torch.device:
    """Where the current run computes (the CPU unless a run set another)."""
    return _current


@contextlib.contextmanager
def using_device(device: torch.device | str | None) -> Iterator[torch.device]:
    """Run the body with ``device`` as the compute device (``None``/``auto`` resolved); the previous one after."""
    global _current
    resolved = device if isinstance(device, torch.device) and device.type != "cuda" else parse_device(device)
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    previous, _current = _current, resolved
    try:
        with _deterministic(resolved.type == "cuda"):
            yield resolved
    finally:
        _current = previous


@contextlib.contextmanager
def _deterministic(enabled: bool) -> Iterator[None]:
    """On CUDA, torch's deterministic algorithms for the run (warning, not failing, where an operation has none)
    and cuBLAS's fixed workspace unless the environment chose one; both restored after. A no-op on the CPU, whose
    kernels are deterministic already."""
    if not enabled:
        yield
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def device_map_for(device: torch.device) -> dict[str, str] | None:
    """``load_model``'s placement of a whole model on ``device``: ``None`` (built on the host explicitly) for the
    CPU, else every module on that one device (never accelerate's ``"auto"``, which ignores the index)."""
    return None if device.type == "cpu" else {"": str(device)}


def is_accelerated() -> bool:
    return _current.type != "cpu"


def to_compute(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """``tensor`` on the compute device (itself when it is there already)."""
    if tensor is None or tensor.device == _current:
        return tensor
    return tensor.to(_current, non_blocking=tensor.is_pinned())


def to_host(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """``tensor`` on the host: what is written or kept between layers."""
    if tensor is None or tensor.device.type == "cpu":
        return tensor
    return tensor.to(HOST)


def host_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` kept on the host between layers; pinned when the compute device is CUDA, so that its move per
    batch is an asynchronous copy."""
    tensor = to_host(tensor)
    if _current.type == "cuda" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor


def moe_on(moe, device: torch.device):
    """A :class:`~moecompress.families.MoEWeights` view whose tensors are on ``device`` (``moe`` itself when they
    are there already); weights move to the compute device for the passes' math and back only to be written."""
    import dataclasses

    moved = {
        item.name: value.to(device)
        for item in dataclasses.fields(moe)
        if isinstance(value := getattr(moe, item.name), torch.Tensor) and value.device != device
    }
    return dataclasses.replace(moe, **moved) if moved else moe
