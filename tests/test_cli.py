"""The entry points, run as users run them: ``python -m rlax_tpu.<component>``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlax_tpu.cli import EXIT_USAGE, unknown_override

REPO = Path(__file__).resolve().parents[1]
COMPONENTS = ["controller", "param_server", "inference", "verifiers", "trainer", "aot"]
LOCAL = "--config=configs/codeforces.py:local"


def run(component: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", f"rlax_tpu.{component}", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("component", COMPONENTS)
def test_help(component):
    out = run(component, "--help")
    assert out.returncode == 0, out.stderr
    assert f"usage: python -m rlax_tpu.{component}" in out.stdout
    assert "--config.SECTION.FIELD=VALUE" in out.stdout


def test_unknown_override_is_named():
    out = run("controller", LOCAL, "--config.bogus=1")
    assert out.returncode == EXIT_USAGE
    assert out.stderr.strip() == (
        "rlax_tpu.controller: error: --config.bogus=1: unknown config field 'bogus' in the top level"
    )
    assert "Traceback" not in out.stderr


def test_unknown_nested_override_gets_a_suggestion():
    out = run("trainer", LOCAL, "--config.trainer.learnig_rate=1e-3")
    assert out.returncode == EXIT_USAGE
    assert (
        "unknown config field 'learnig_rate' in trainer; did you mean 'trainer.learning_rate'?"
        in out.stderr
    )


def test_bad_value_gets_a_validation_error():
    out = run("param_server", LOCAL, "--config.param_server.in_memory_versions=1")
    assert out.returncode == EXIT_USAGE
    assert "config error: param_server.in_memory_versions = 1: must be >= 2" in out.stderr


def test_unparsable_value_names_the_flag():
    out = run("controller", LOCAL, "--config.trainer.learning_rate=fast")
    assert out.returncode == EXIT_USAGE
    assert "--config.trainer.learning_rate=fast" in out.stderr and "Traceback" not in out.stderr


def test_bad_preset_and_missing_file():
    out = run("controller", "--config=configs/codeforces.py:v6e")
    assert out.returncode == EXIT_USAGE
    assert "unknown preset 'v6e'" in out.stderr and "Traceback" not in out.stderr
    out = run("controller", "--config=configs/nope.py")
    assert out.returncode == EXIT_USAGE
    assert "no such config file 'configs/nope.py'" in out.stderr


def test_overrides_reach_the_validated_config():
    out = run(
        "controller",
        LOCAL,
        "--config.trainer.learning_rate=3e-6",
        "--config.verifiers.languages=('python','cpp')",
        "--print_config",
    )
    assert out.returncode == 0, out.stderr
    cfg = json.loads(out.stdout)
    assert cfg["preset"] == "local"
    assert cfg["trainer"]["learning_rate"] == 3e-6
    assert cfg["verifiers"]["languages"] == ["python", "cpp"]


def test_no_config_flag_uses_the_machine_preset():
    out = run("controller", "--print_config")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["preset"] == "local"


def test_controller_rejects_stray_arguments():
    out = run("controller", LOCAL, "extra")
    assert out.returncode == EXIT_USAGE
    assert "unexpected arguments ['extra']" in out.stderr


def test_unknown_override_helper():
    assert unknown_override(["prog", "--config.trainer.learning_rate=1"]) is None
    assert unknown_override(["prog", "--config.mesh.tensor.x=1"]) == (
        "--config.mesh.tensor.x=1: unknown config field 'x' in mesh.tensor"
    )


_SIGNAL_TO_A_THREAD = """
import signal, threading, time
from rlax_tpu import cli

stop = cli.stop_event()
threading.Thread(target=lambda: (time.sleep(0.3),
                                 signal.pthread_kill(threading.get_ident(), signal.SIGTERM))).start()
{wait}
print("stopped", flush=True)
"""


@pytest.mark.parametrize("wait, stops", [("cli.wait_for(stop)", True), ("stop.wait()", False)])
def test_a_stop_signal_delivered_to_another_thread_still_stops_the_main_thread(wait, stops):
    # The kernel may hand a process-directed SIGTERM to any thread; here it goes to a helper on
    # purpose. A bare Event.wait() in the main thread never runs the handler (the control case).
    code = _SIGNAL_TO_A_THREAD.format(wait=wait)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate(timeout=5)
        assert stops and out == "stopped\n"
    except subprocess.TimeoutExpired:
        assert not stops, "cli.wait_for missed a SIGTERM delivered to another thread"
    finally:
        proc.kill()
        proc.wait()
