"""A server bound to the test run (`bound_to_this_process`) ends with its whole process
group: when the run dies however it dies, when its leader is sent SIGTERM, and by SIGKILL
after the grace when the server ignores SIGTERM (vLLM during its start-up)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.processes import REPO_ROOT, bound_to_this_process, process_group_pids

# A server with a child of its own, as vLLM's API server and engine core.
SERVER = ("import signal, subprocess, sys, time\n"
          "if sys.argv[1] == 'ignore': signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
          "subprocess.Popen(['sleep', '60'])\n"
          "time.sleep(60)\n")
STARTER = """\
import subprocess, sys
from tests.processes import bound_to_this_process
server = [sys.executable, "-c", sys.argv[1], sys.argv[2]]
cmd = bound_to_this_process(server, grace_s=1.0) if sys.argv[3] == "bound" else server
print(subprocess.Popen(cmd, start_new_session=True).pid, flush=True)
subprocess.run(["sleep", "60"])
"""


def _wait_for(condition, timeout_s: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _name(pid: int) -> str:
    """The process's command name; "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _has_its_sleep(pgid: int) -> bool:
    """The server's own child runs (the group is fully started)."""
    return any(_name(p) == "sleep" for p in process_group_pids(pgid))


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _outlives_its_starter(mode: str, binding: str, wait_s: float) -> bool:
    """Start the server from a child process, SIGKILL that child once the server's group is
    up, and say whether any of the group is still there `wait_s` later."""
    starter = subprocess.Popen([sys.executable, "-c", STARTER, SERVER, mode, binding],
                               cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    assert starter.stdout is not None
    pgid = int(starter.stdout.readline())
    try:
        assert _wait_for(lambda: _has_its_sleep(pgid), 20)
        starter.kill()
        starter.wait()
        return not _wait_for(lambda: not process_group_pids(pgid), wait_s)
    finally:
        _kill_group(pgid)


def test_the_group_ends_with_the_run_that_started_it() -> None:
    assert not _outlives_its_starter("obey", "bound", wait_s=10)


def test_a_server_ignoring_sigterm_is_killed_after_the_grace() -> None:
    assert not _outlives_its_starter("ignore", "bound", wait_s=10)


def test_an_unbound_server_would_outlive_it() -> None:
    """What the binding prevents: the same server, unbound, outlives its killed starter."""
    assert _outlives_its_starter("obey", "plain", wait_s=1)


def test_sigterm_to_the_leader_ends_the_group_with_the_servers_code() -> None:
    leader = subprocess.Popen(bound_to_this_process([sys.executable, "-c", SERVER, "obey"]),
                              start_new_session=True)
    try:
        assert _wait_for(lambda: _has_its_sleep(leader.pid), 20)
        leader.send_signal(signal.SIGTERM)
        assert leader.wait(10) == -signal.SIGTERM  # the server's own end, passed on
        assert _wait_for(lambda: not process_group_pids(leader.pid), 10)
    finally:
        _kill_group(leader.pid)


def test_a_server_started_from_a_thread_that_ended_keeps_running() -> None:
    """The suite starts servers from pool threads, which end once their server is up: the
    binding follows the process, not the thread."""
    started: list[subprocess.Popen[bytes]] = []

    def start() -> None:
        leader = subprocess.Popen(bound_to_this_process([sys.executable, "-c", SERVER, "obey"]),
                                  start_new_session=True)
        started.append(leader)
        _wait_for(lambda: _has_its_sleep(leader.pid), 20)  # up, as start_native_server

    starter = threading.Thread(target=start)
    starter.start()
    starter.join()
    (leader,) = started
    try:
        assert _has_its_sleep(leader.pid)
        time.sleep(1.5)  # three of the leader's checks of its parent
        assert leader.poll() is None and _has_its_sleep(leader.pid)
    finally:
        leader.send_signal(signal.SIGTERM)
        leader.wait(10)
