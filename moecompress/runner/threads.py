"""The CPU thread count a run's bytes depend on.

torch's CPU reductions (matmuls, sums, the SVDs of the adapters, the evaluation) split their work by thread and round
differently with another split, so a run with 2 threads can write other bytes than one with 1. Prune, RTN and GPTQ
quantisation give the same bytes with 1 and 2 threads on tiny-moe (tests/test_threads.py), the default recipe does
not. A run therefore records its count in its resume state and its report, and a resume with another count is
refused instead of finishing with a mixture of both."""

from __future__ import annotations

from pathlib import Path

from ..errors import OptionError
from ..vocabulary import named


def thread_count() -> int:
    """torch's intra-op thread count (``OMP_NUM_THREADS``, or ``torch.set_num_threads``): numba's kernels use it too."""
    import torch

    return torch.get_num_threads()


def check_resume_threads(recorded: object, directory: Path) -> None:
    """Refuse to resume the interrupted run in ``directory`` when it recorded another thread count than this
    process has (a run recorded before counts were kept is resumed as it is)."""
    current = thread_count()
    if recorded is None or recorded == current:
        return
    raise OptionError(
        f"{directory}: the interrupted run's CPU thread count was {recorded} and this one's is {current}, and the "
        f"output depends on it; resume with OMP_NUM_THREADS={recorded} (torch.set_num_threads({recorded}) in "
        f"Python), or discard it with {named('run.restart', True)}"
    )
