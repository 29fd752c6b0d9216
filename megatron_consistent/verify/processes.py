"""Child processes that take their descendants with them.

An engine run (``check``'s rollouts, the gates', the soak's, the lifecycle scenarios) is a process that spawns others:
vLLM's engine core, its workers, compile workers.  Killing only the process we started on a timeout leaves those
holding GPU memory (the next engine then fails to start, or a later run waits on them).  So every run here starts as
the leader of its own process group (a new session) and, when it ends -- normally, by a crash, or past its time --
whatever is left of its group is killed: no call waits forever on a hung engine, and none leaves one behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

ENGINE_TIMEOUT_S = 3600.0  # one engine run (start, compile, generate) may take this long before it counts as hung


def kill_group(pgid: int) -> None:
    """SIGKILL every process left in group ``pgid`` (none left: nothing to do)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # no process left in the group
        pass


def stop_group(proc: subprocess.Popen) -> None:
    """A process started with ``start_new_session=True`` and whatever is left of its group: killed and reaped."""
    kill_group(proc.pid)
    proc.wait()


def run_group(argv: list[str], log_path: str | Path, timeout_s: float | None, env: dict | None = None) -> int | None:
    """``argv`` in its own process group, stdout and stderr to ``log_path``: its exit code, or None when it ran past
    ``timeout_s`` seconds.  Either way, every process still in its group afterwards is killed."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        finally:
            stop_group(proc)
