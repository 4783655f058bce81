"""An ordered parallel map with a bounded window, for prepare's decoding and FID's resizing.

Results come back in input order, so the output never depends on the worker count, and only `window`
chunks are in flight at once, so memory is bounded by the window, not by the input. Use it as
`with contextlib.closing(ordered_map(...)) as results:` so the workers stop as soon as the caller does.
"""

import multiprocessing
import os
import signal
import sys
from collections import deque
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor


def cores() -> int:
    """CPU cores this process may run on: its affinity mask, which is what SLURM or taskset gave the job."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def die_with_parent() -> None:
    """In a child process: the kernel sends it SIGKILL when its parent dies (Linux prctl), so a killed parent
    leaves nothing running on: no FID scorer past its timeout, no worker waiting on a queue nobody will close."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the parent's own shutdown still ends the workers


def _worker_init() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it cancels the work and shuts down
    die_with_parent()


def _run_chunk(fn, chunk) -> list:
    return [fn(x) for x in chunk]


def ordered_map(fn, items, workers: int, chunk: int = 1, window: int | None = None, processes: bool = False,
                start: str = "fork"):
    """Yield fn(item) for each item of the sequence `items`, in order, computed by `workers` threads or processes.

    Work is handed out in chunks of `chunk` items, at most `window` chunks ahead of the caller (default
    2 per worker). workers <= 1 runs everything in this thread, with no pool at all. With processes=True,
    `fn` and the items must pickle (a module-level function, or functools.partial of one); an exception
    raised by `fn` is raised here, in order, when its item's turn comes.

    `start` (Linux; elsewhere always "spawn"): "fork" starts the processes in milliseconds, but a fork copies
    only the calling thread, with every lock the others held at that instant: only for a caller that runs no
    other threads. A caller with CUDA, NCCL, gloo or OpenMP threads gives "spawn" (Python's multiprocessing
    docs; 3.12 warns on fork in a threaded process): fresh interpreters, about 0.2 s more. Not "forkserver":
    its workers are the server's children and hold its lifeline open, so a killed caller would leave the
    server and the workers waiting on each other, where a spawned worker dies with its parent (die_with_parent).
    """
    if start not in ("fork", "spawn"):
        raise ValueError(f"start={start!r}; use 'fork' or 'spawn'")
    chunks = (items[i:i + chunk] for i in range(0, len(items), chunk))
    if workers <= 1:
        for c in chunks:
            yield from _run_chunk(fn, c)
        return
    if processes:
        context = multiprocessing.get_context(start if sys.platform == "linux" else "spawn")
        pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_init)
    else:
        pool = ThreadPoolExecutor(workers)
    window = window or 2 * workers
    pending = deque()
    try:
        for c in chunks:
            pending.append(pool.submit(_run_chunk, fn, c))
            if len(pending) >= window:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
