"""`python -m rlax_tpu.controller`'s stop after SIGTERM: bounded by controller.stop_grace_s."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from tests.child_env import child_env

# A process that takes SIGTERM as the controller does, with a thread that never ends (what
# would keep a stopped controller alive past its grace).
STUCK = textwrap.dedent(
    """
    import signal, sys, threading
    from rlax_tpu.controller import __main__ as m
    m._STOP_GRACE_S[0] = 1.0
    signal.signal(signal.SIGTERM, m._on_sigterm)
    threading.Thread(target=threading.Event().wait, name="stuck").start()
    try:
        print("ready", flush=True)
        threading.Event().wait()
    except m.Terminated:
        print("terminated", flush=True)
        sys.exit(m.EXIT_TERMINATED)  # joining the stuck thread never returns
    """
)


def test_a_process_that_will_not_stop_exits_after_its_grace_with_every_threads_stack():
    proc = subprocess.Popen(
        [sys.executable, "-c", STUCK],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143 and out == "terminated\n", (out, err)
    assert "still running 1 s after SIGTERM (controller.stop_grace_s)" in err
    assert "Thread 0x" in err and "in wait" in err  # the stuck thread's stack
