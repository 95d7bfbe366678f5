"""Run a server as the child of its process group's leader, which ends the whole group when
sent SIGTERM or when the test run that started it dies.

    python tests/group_leader.py PARENT_PID GRACE_S CMD...

A server started in a session of its own is out of reach of a signal to the test run's
process group, and vLLM's API server neither reliably handles a SIGTERM that arrives during
its start-up nor takes its engine core down when it is killed. So the leader watches its
parent (every POLL_S; a parent that died leaves it another), and on its death, or on a
SIGTERM of its own, sends SIGTERM to the group (vLLM's orderly shutdown), then SIGKILL to
whatever is left after GRACE_S seconds. It exits as the server did. The kernel's
parent-death signal is not used: it follows the thread that started the server, and the
suite starts servers from pool threads that end at once.
Used through `tests.processes.bound_to_this_process`.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
from types import FrameType

POLL_S = 0.5


def end_group(grace_s: float, _signum: int, _frame: FrameType | None) -> None:
    """SIGTERM to the group now, SIGKILL to it after the grace (an interval timer: the main
    thread stays in its wait for the server)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)
    signal.setitimer(signal.ITIMER_REAL, grace_s)


def kill_group(_signum: int, _frame: FrameType | None) -> None:
    os.killpg(0, signal.SIGKILL)


def main(parent: int, grace_s: float, cmd: list[str]) -> int:
    signal.signal(signal.SIGALRM, kill_group)
    signal.signal(signal.SIGTERM, functools.partial(end_group, grace_s))
    child = subprocess.Popen(cmd)
    while True:
        try:
            code = child.wait(POLL_S)
            break
        except subprocess.TimeoutExpired:
            ending = signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # end_group ran
            if not ending and os.getppid() != parent:  # the run is gone
                end_group(grace_s, signal.SIGTERM, None)
    if code < 0:  # ended by a signal: the leader ends by the same one, for its starter to see
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]))
