"""Results remembered on disk across processes, for a grader that runs the same replays for every submission.

An autograder executes each submission's notebook in a fresh kernel, so ``functools.lru_cache`` forgets between
students what every student's notebook computes alike: the capstone's replays of today's service and of the
lesson's candidate fixes, and of any fix another student already submitted. ``remembered(kind, key, compute)``
keeps such a result in a folder named by the environment variable ``KVLAB_REPLAY_CACHE`` (unset: nothing is kept,
and ``compute`` runs every time). ``python -m autograde`` sets it for the kernels it starts.

An entry is found only by the same ``key`` under the same code: its file name hashes the key with every source
and data file of the installed ``kvlab`` package, the Python and torch versions and the machine type, so an
upgrade or a local edit never reads an older result. Only results that are a function of their key belong here
(a replay on the simulated clock; greedy answers on one machine); a timing kept with such a result (the wall clock
of a replay on the checkpoint) is the storing run's.

The files are pickles. Only put the folder where nobody but the grader writes: a pickle runs code when read.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import platform
import sys
import tempfile
from collections.abc import Callable, Hashable
from functools import lru_cache
from pathlib import Path
from typing import TypeVar

CACHE_ENV = "KVLAB_REPLAY_CACHE"
T = TypeVar("T")


def remembered(kind: str, key: Hashable, compute: Callable[[], T]) -> T:
    """``compute()``, or the result a process with the same code stored for ``(kind, key)``; ``key``'s ``repr``
    must name everything the result depends on besides the code."""
    folder = os.environ.get(CACHE_ENV)
    if not folder:
        return compute()
    digest = hashlib.sha256(repr((code_version(), kind, key)).encode()).hexdigest()[:32]
    path = Path(folder) / f"{kind}-{digest}.pkl"
    try:
        return pickle.loads(path.read_bytes())
    except Exception:  # noqa: BLE001 (missing, torn or foreign: computed again, and replaced below)
        pass
    value = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written aside, then renamed: parallel graders (``--jobs``) never read half a file.
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
            f.write(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        os.replace(f.name, path)
    except OSError:  # a folder it cannot write: the result stands, only the saving is lost
        pass
    return value


@lru_cache(maxsize=1)
def code_version() -> str:
    """A hash of every file of the installed ``kvlab`` package (sources and data), the Python and torch versions,
    and the machine type."""
    import torch

    root = Path(__file__).resolve().parent
    h = hashlib.sha256(f"{sys.version}|{torch.__version__}|{platform.machine()}".encode())
    for file in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        h.update(str(file.relative_to(root)).encode())
        h.update(file.read_bytes())
    return h.hexdigest()
