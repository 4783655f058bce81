"""The ordered parallel map behind prepare's decoding and FID's resizing: order, bounded memory, clean stops."""

import contextlib
import functools
import multiprocessing
import os
import subprocess
import sys
import threading
import time

import pytest

from diffrelay.runtime import parallel


def slow_square(x):
    time.sleep(0.001 * (x % 3))  # uneven work, so completion order differs from input order
    return x * x


def fail_at(bad, x):
    if x == bad:
        raise ValueError(f"item {x}")
    return x


@pytest.mark.parametrize("workers, processes", [(1, False), (3, False), (3, True)])
def test_results_come_back_in_input_order(workers, processes):
    out = list(parallel.ordered_map(slow_square, range(50), workers, chunk=4, processes=processes))
    assert out == [x * x for x in range(50)]


def test_work_in_flight_stays_within_the_window():
    started, lock = [], threading.Lock()

    def record(x):
        with lock:
            started.append(x)
        return x

    ahead = []
    with contextlib.closing(parallel.ordered_map(record, range(200), 2, chunk=5, window=3)) as results:
        for consumed, x in enumerate(results, 1):
            assert x == consumed - 1
            time.sleep(0.001)  # a slow consumer: workers would run far ahead if nothing held them
            with lock:
                ahead.append(len(started) - consumed)
    # At most `window` chunks of 5 are handed out beyond the one being read.
    assert max(ahead) <= 3 * 5
    assert len(started) == 200


def test_an_error_is_raised_in_order_and_the_processes_stop():
    results = parallel.ordered_map(functools.partial(fail_at, 13), range(40), 2, chunk=3, processes=True)
    seen = []
    with pytest.raises(ValueError, match="item 13"):
        with contextlib.closing(results):
            for x in results:
                seen.append(x)
    assert seen == list(range(12))  # everything before the bad item's chunk, nothing after
    assert multiprocessing.active_children() == []


def test_stopping_early_leaves_no_worker_process():
    with contextlib.closing(parallel.ordered_map(slow_square, range(1000), 2, chunk=2, processes=True)) as results:
        assert next(results) == 0
        assert len(multiprocessing.active_children()) == 2
    assert multiprocessing.active_children() == []


def pid_of(_):
    return os.getpid()


def running(pid: int) -> bool:
    """A process that exists and is not a zombie (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_spawned_processes_give_the_same_results_and_stop():
    """start="spawn", for a caller with CUDA or NCCL threads (latent prepare)."""
    out = list(parallel.ordered_map(slow_square, range(50), 3, chunk=4, processes=True, start="spawn"))
    assert out == [x * x for x in range(50)]
    assert multiprocessing.active_children() == []
    with pytest.raises(ValueError, match="'forkserver'; use 'fork' or 'spawn'"):
        next(parallel.ordered_map(pid_of, range(4), 2, processes=True, start="forkserver"))


KILLED = """
import os, sys, time
from diffrelay.runtime import parallel

def pid_of(_):
    time.sleep(0.01)
    return os.getpid()

if __name__ == "__main__":
    results = parallel.ordered_map(pid_of, range(10000), 2, processes=True, start=sys.argv[1])
    print(*{next(results) for _ in range(20)}, flush=True)
    os._exit(137)  # killed mid-map, as prepare is by SIGKILL
"""


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_killed_caller_leaves_no_worker_behind(tmp_path, start):
    """The workers die with their parent. (A fork server's workers would not: they hold the server's lifeline
    open, the server keeps them, and whoever reads the caller's output waits forever.)"""
    (tmp_path / "killed.py").write_text(KILLED)
    p = subprocess.run([sys.executable, str(tmp_path / "killed.py"), start], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 137, p.stderr
    pids = set(map(int, p.stdout.split()))
    assert len(pids) == 2 and os.getpid() not in pids
    deadline = time.monotonic() + 10
    while pids and time.monotonic() < deadline:
        pids = {p for p in pids if running(p)}
        time.sleep(0.05)
    assert not pids


def test_cores_is_the_affinity_mask():
    assert parallel.cores() == len(os.sched_getaffinity(0)) >= 1
