"""Where one thread's wall time goes: a sampling profiler for the benchmarks.

cProfile on Python 3.12 records every thread at once (it runs on ``sys.monitoring``), so the store's reader threads'
calls mix into the decoding thread's table and its times say little about what a step waits for. ``sampled`` runs
``fn`` on the calling thread while a helper thread looks at that thread's stack every ``interval`` seconds
(``sys._current_frames``): each sample counts once for the innermost function (``self``: where the thread was,
including a wait for the GIL, a lock or the GPU inside a C call made from there) and once for every function on the
stack (``total``). Counts times the interval approximate wall time; the sampler's own GIL use costs a few percent.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from pathlib import Path


def _where(code) -> str:
    return f"{Path(code.co_filename).name}:{code.co_firstlineno}({code.co_name})"


def _has(frame, match: str) -> bool:
    while frame is not None:
        if match in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def sampled(path: str, fn, *args, interval: float = 0.001, top: int = 40, title: str | None = None,
            append: bool = False, match: str | None = None):
    """``fn(*args)`` with its thread sampled; a table (by self and by total samples) written to ``path`` (after
    what it holds with ``append``, under ``title``). With ``match``, every thread whose stack has a frame from a
    file whose path contains it is sampled instead (``fn`` hands the work to another thread: NeMo's event loop,
    an executor)."""
    target = threading.get_ident()
    own: collections.Counter = collections.Counter()
    total: collections.Counter = collections.Counter()
    done = threading.Event()
    count = [0]

    def sample():
        me = threading.get_ident()
        while not done.wait(interval):
            frames = sys._current_frames()
            if match is None:
                frame = frames.get(target)
            else:
                frame = next((f for ident, f in frames.items() if ident != me and _has(f, match)), None)
            if frame is None:
                continue
            count[0] += 1
            own[_where(frame.f_code)] += 1
            seen = set()
            while frame is not None:
                where = _where(frame.f_code)
                if where not in seen:
                    seen.add(where)
                    total[where] += 1
                frame = frame.f_back

    thread = threading.Thread(target=sample, name="flashguard-sampler", daemon=True)
    t0 = time.perf_counter()
    thread.start()
    try:
        result = fn(*args)
    finally:
        done.set()
        thread.join()
    wall = time.perf_counter() - t0
    n = max(1, count[0])
    lines = [f"## {title}", ""] if title else []
    lines += [f"{count[0]} samples over {wall:.3f} s of wall time (one every {wall / n * 1e3:.2f} ms)", "",
             "by self (the innermost Python function, its C calls included):", ""]
    lines += [f"{c / n * 100:6.1f}%  {c * wall / n:8.3f} s  {w}" for w, c in own.most_common(top)]
    lines += ["", "by total (on the stack):", ""]
    lines += [f"{c / n * 100:6.1f}%  {c * wall / n:8.3f} s  {w}" for w, c in total.most_common(top)]
    with open(path, "a" if append else "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n\n")
    return result
