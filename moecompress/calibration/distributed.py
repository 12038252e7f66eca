"""Calibration sharded over the ranks of a ``torch.distributed`` job (``torchrun``, ``accelerate launch``).

Each rank runs the layer-wise sweep on its own contiguous block of whole calibration batches, keeps every
statistic as sums and counts, and the sums are added over ranks in float64, so the result equals the
single-process one up to float64 rounding of the additions. Contiguous blocks in rank order also make a
gather in rank order the single-process token order. Rank 0 alone writes (:func:`on_writer`); the others wait
for it and return its result. Outside a distributed job every function here is the identity on one rank.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..errors import UserInputError

T = TypeVar("T")

WRITER_WAIT = timedelta(hours=24)
"""How long the other ranks wait for rank 0 to write (a checkpoint of hundreds of GB, an evaluation). A rank
that dies ends the job through the launcher, so this is a last resort, not the way failures are noticed."""

_control: tuple[Any, Any] | None = None


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def init_from_environment() -> bool:
    """Join the job ``torchrun`` or ``accelerate launch`` describes in the environment (``WORLD_SIZE`` above 1)
    unless a process group exists already; NCCL where CUDA is available, with one device per rank
    (``cuda:LOCAL_RANK``), gloo otherwise. True when distributed."""
    if active():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not dist.is_available():
        return False
    if torch.cuda.is_available():
        device = local_cuda_device()
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    atexit.register(_leave)
    return True


def _leave() -> None:
    """Destroy the groups this module created before the interpreter exits: a gloo group left to the
    interpreter's teardown aborts the process ("terminate called without an active exception") in about 2 of 5
    runs, turning a finished job into a failed one. No barrier first: a rank leaving after an error must not wait
    for ranks that are stuck in a collective."""
    global _control
    _control = None
    if active():
        dist.destroy_process_group()


def local_cuda_device() -> torch.device:
    """This rank's GPU: ``cuda:LOCAL_RANK`` (modulo the GPUs torch sees)."""
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % max(torch.cuda.device_count(), 1))


def rank_device(spec: str | None) -> torch.device:
    """The compute device of this rank for ``--device`` ``spec``: in an NCCL job, ``auto`` and ``cuda`` mean this
    rank's own GPU (``cuda:LOCAL_RANK``); otherwise :func:`~moecompress.device.parse_device`."""
    from ..device import parse_device

    device = parse_device(spec)
    if device.type == "cuda" and active() and dist.get_backend() == "nccl" and (spec or "auto") in ("auto", "cuda"):
        return local_cuda_device()
    return device


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def is_writer() -> bool:
    """Only rank 0 writes files and prints."""
    return rank() == 0


def barrier() -> None:
    if active():
        dist.barrier()


def _control_group():
    """A gloo group with a long timeout for rank 0's hand-over: the default group's timeout (NCCL's minutes) is
    for collectives that all ranks reach together, not for waiting on rank 0's writing."""
    global _control
    world = dist.group.WORLD
    if _control is None or _control[0] is not world:
        _control = (world, dist.new_group(backend="gloo", timeout=WRITER_WAIT))
    return _control[1]


@contextmanager
def collective_phase() -> Iterator[None]:
    """Work every rank does together (the measuring sweep). An error escaping it is not handed over by an
    enclosing :func:`on_writer`: the other ranks are inside collectives, not waiting for rank 0; each raises its own
    error or is stopped by the launcher when this rank exits."""
    try:
        yield
    except BaseException as error:
        error.shared_over_ranks = True
        raise


def on_writer(work: Callable[[], T], *, share: bool = True) -> T | None:
    """Rank 0 alone runs ``work`` (whatever writes files); the other ranks wait for it and get its result (None
    with ``share=False``, for results that are rank 0's own, such as an open writer). An error in ``work`` is
    raised on every rank: a :class:`UserInputError` as one with the same message, anything else as a
    RuntimeError naming it. Every rank must call this at the same point; outside a job it is ``work()``."""
    if world_size() <= 1:
        return work()
    group = _control_group()
    if is_writer():
        try:
            value = work()
        except BaseException as error:
            if not getattr(error, "shared_over_ranks", False):
                message = ["error", isinstance(error, UserInputError), f"{type(error).__name__}: {error}", str(error)]
                dist.broadcast_object_list([message], src=0, group=group)
                error.shared_over_ranks = True
            raise
        dist.broadcast_object_list([["ok", value if share else None]], src=0, group=group)
        return value
    received: list[Any] = [None]
    dist.broadcast_object_list(received, src=0, group=group)
    status, *payload = received[0]
    if status == "ok":
        return payload[0]
    is_user_error, described, message = payload
    error = UserInputError(message) if is_user_error else RuntimeError(f"rank 0 failed: {described}")
    error.shared_over_ranks = True
    raise error


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sum_over_ranks(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor summed over ranks, in float64 (one all-reduce for all of them)."""
    flat = (
        torch.cat([t.detach().reshape(-1).to(device="cpu", dtype=torch.float64) for t in tensors])
        if tensors
        else torch.zeros(0, device="cpu")
    )
    if active() and world_size() > 1:
        flat = flat.to(_device())
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat = flat.cpu()
    out, start = [], 0
    for tensor in tensors:
        out.append(flat[start : start + tensor.numel()].reshape(tensor.shape))
        start += tensor.numel()
    return out


def gather_in_rank_order(values: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Every rank's 1-D ``values`` concatenated in rank order (lengths may differ), and each rank's length."""
    values = values.detach().reshape(-1)
    if not active() or world_size() <= 1:
        return values, [values.numel()]
    device = _device()
    lengths = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world_size())]
    dist.all_gather(lengths, torch.tensor([values.numel()], dtype=torch.long, device=device))
    sizes = [int(n) for n in lengths]
    padded = torch.zeros(max(sizes), dtype=values.dtype, device=device)
    padded[: values.numel()] = values.to(device)
    pieces = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(pieces, padded)
    return torch.cat([piece[:n].cpu() for piece, n in zip(pieces, sizes, strict=True)]), sizes


@dataclass
class CalibrationShard:
    """This rank's batches and the tags of their tokens (flat, in the batches' order)."""

    batches: list[dict[str, torch.Tensor]]
    tags: torch.Tensor


def shard_calibration(batches: list[dict[str, torch.Tensor]], tags: torch.Tensor) -> CalibrationShard:
    """Rank ``r`` of ``W`` gets batches ``[r·n/W, (r+1)·n/W)`` whole (a batch's tensors are never split, so each
    token is computed exactly as in one process) and the slice of ``tags`` their ``input_ids`` cover."""
    tags = tags.reshape(-1)
    count, ranks, me = len(batches), world_size(), rank()
    if ranks == 1:
        return CalibrationShard(batches, tags)
    if count < ranks:
        raise UserInputError(
            f"{count} calibration batch(es) cannot be shared by {ranks} ranks; "
            "give more calibration tokens or a smaller batch size"
        )
    sizes = [int(batch["input_ids"].numel()) for batch in batches]
    if sum(sizes) != tags.numel():
        raise ValueError(f"the batches hold {sum(sizes)} tokens but {tags.numel()} tags were given")
    first, last = me * count // ranks, (me + 1) * count // ranks
    offset = sum(sizes[:first])
    return CalibrationShard(batches[first:last], tags[offset : offset + sum(sizes[first:last])])
