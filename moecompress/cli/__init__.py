"""The ``moecompress`` command line: thin Click commands over the library.

The console script imports this package before anything imports torch, so the process-wide setting the commands
want is made here rather than in ``import moecompress``: torch backs tensors of 2 MiB and more with transparent
huge pages when ``THP_MEM_ALLOC_ENABLE`` is set before it starts. Streaming a checkpoint allocates a layer's worth
of fresh memory per layer, and with 4 KiB pages the page faults cost about a quarter of an MXFP4 rewrite
(BENCHMARKS.md). A user's own value (0 opts out) is kept; it has no effect once torch is loaded.

``OMP_WAIT_POLICY=PASSIVE`` likewise, unless the user set it: libgomp's idle threads then sleep at once instead of
spinning, and on a machine whose cores other processes also use the spinning threads took the cores from the
working ones; the default recipe ran several times slower with 2 threads than with 1 (BENCHMARKS.md, "Threads").
"""

import os as _os
import sys as _sys

if "torch" not in _sys.modules:
    _os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
