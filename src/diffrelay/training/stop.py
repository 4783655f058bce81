"""Stop requests: a signal (SLURM's warning, preemption, Ctrl-C) becomes a recovery checkpoint at the next
step, and a rank that cannot reach the next step (a dead peer) ends with one line instead of hanging."""

import os
import signal
import sys
import threading
import time

from diffrelay.runtime import distributed

GRACE_SECONDS = 60  # after a stop signal, how long a rank may wait in a step before giving up


class StopRequest:
    """Remembers SIGTERM/SIGUSR1 (SLURM's warning before the time limit) or SIGINT (Ctrl-C) until the
    loop can act on it: every rank finishes its step, a recovery checkpoint is written, and the job exits.

    A rank blocked in a collective whose peer died never reaches that point (NCCL waits for its watchdog,
    10 minutes, then dumps C++ stacks). So a watcher thread learns of the signal through the interpreter's
    wake-up fd (written by the C handler even while the main thread sits in a collective) and, if no step
    finishes within the grace time, ends the process with one line. The grace is at least GRACE_SECONDS and
    3 times the longest step so far, so a real stop of a healthy job always gets its recovery checkpoint."""

    def __init__(self, grace_floor: float = GRACE_SECONDS, exit=os._exit):
        self.signum, self.acknowledged, self.longest_step = None, False, 0.0
        self._grace_floor, self._exit = grace_floor, exit
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._handle)
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._old_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, name="diffrelay-stop-watch", daemon=True)
        self._watcher.start()

    def _handle(self, signum, frame):
        self.signum = signum

    def _watch(self) -> None:
        if not os.read(self._read, 1):  # EOF: closed at the segment's end
            return
        grace = max(self._grace_floor, 3 * self.longest_step)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if self.acknowledged or self._write is None:
                return
            time.sleep(0.1)
        print(f"diffrelay: error: rank {distributed.env_rank()}: no step finished within {grace:.0f} s of the stop "
              "signal: another rank died or a collective hangs; exiting without a recovery checkpoint",
              file=sys.stderr, flush=True)
        self._exit(1)

    def close(self) -> None:
        signal.set_wakeup_fd(self._old_fd)
        write, self._write = self._write, None
        os.close(write)  # the watcher reads EOF and ends
        self._watcher.join()
        os.close(self._read)
