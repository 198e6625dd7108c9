"""Starting the engine's child processes without running the user's script again, and
without the CPU pinning of the thread that starts them.

multiprocessing's spawn re-imports the parent's `__main__` in every child (as
`__mp_main__`), so that a target defined there can be found. Our targets live in engine
modules, never in the user's script; but a script without an `if __name__ ==
"__main__":` guard (vLLM's offline examples have none) would run its own top level
again in each child: `LLM(tensor_parallel_size=2)` there starts another engine, which
dies mid-bootstrap. While `start` runs, the parent's main module is shown to
multiprocessing as having no file and no spec, which is how an interactive session looks,
and the child imports nothing of it. A child also inherits the CPU set of the thread
that starts it; one that has stepped an offline engine is pinned to a single core, so
the start runs with that thread's CPU set from before the pinning.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from multiprocessing.process import BaseProcess

_lock = threading.Lock()
_HIDDEN = ("__file__", "__spec__")


def start(proc: BaseProcess) -> None:
    """proc.start(), with the user's main module kept out of the child."""
    main = sys.modules["__main__"]
    # Only kernels.cpu pins threads: where it was never loaded, no thread here is pinned
    # (and the HTTP process, which starts the engine process, need not load torch for it).
    cpu = sys.modules.get("kernels.cpu")
    with _lock, (cpu.unpinned() if cpu is not None else contextlib.nullcontext()):
        saved = {k: main.__dict__[k] for k in _HIDDEN if k in main.__dict__}
        main.__dict__.pop("__file__", None)
        main.__dict__["__spec__"] = None
        try:
            proc.start()
        finally:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)
