import os
import subprocess
import sys
from pathlib import Path

import jax

REPO = Path(__file__).resolve().parents[1]


def test_eight_cpu_devices_for_sharding_tests():
    assert jax.device_count() == 8
    assert {d.platform for d in jax.devices()} == {"cpu"}


BURN = "    subprocess.run([sys.executable, '-c', 'sum(range(30_000_000))'], check=True)\n"


def test_the_cpu_log_counts_each_tests_own_and_its_childrens_cpu(tmp_path):
    (tmp_path / "test_burn.py").write_text(
        "import subprocess, sys\n"
        "import jax\n"
        # A program no other test compiles (the constant): the run's cache does not have it.
        "def test_compiles():\n    jax.jit(lambda x: x * 0.918273645)(1.0)\n"
        "def test_child_burns():\n" + BURN + "def test_child_burns_and_says_why():\n"
        '    """Cost: a child that burns on purpose."""\n'
        + BURN
        +
        # Last: the first test of a module also pays for its fixtures and the run's first hooks.
        "def test_idle():\n    pass\n"
    )
    log = tmp_path / "cpu.tsv"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", str(tmp_path)],
        cwd=REPO,
        env=os.environ | {"RLAX_TEST_CPU_LOG": str(log), "RLAX_TEST_CPU_BUDGET_S": "0.3"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # Node ids are relative to the rootdir pytest picks, which depends on where tmp_path is.
    logged = {  # node -> (CPU s, compiles, seconds making programs)
        node.rsplit("/", 1)[-1]: (float(cpu), int(n), float(jit))
        for cpu, node, n, jit in (line.split("\t") for line in log.read_text().splitlines())
    }
    burns, why, idle, compiled = (
        f"test_burn.py::test_{n}"
        for n in ("child_burns", "child_burns_and_says_why", "idle", "compiles")
    )
    assert sorted(logged) == [burns, why, compiled, idle]
    assert logged[compiled][1] >= 1 and logged[idle][1] == 0
    assert logged[compiled][2] > 0 and logged[idle][2] == 0
    rows = {node: cpu for node, (cpu, _, _) in logged.items()}
    # The child's loop is CPU the worker itself never spent: it is counted.
    assert rows[burns] > 0.3 > rows[idle] and rows[why] > 0.3
    # The run ends with the costliest tests and names the one over budget that does not say why.
    summary = done.stdout[done.stdout.index("costliest tests by CPU seconds") :]
    assert (
        sum(ln.endswith(("burns", "says_why", "idle", "compiles")) for ln in summary.splitlines())
        == 4
    )
    # (test_compiles may be over too: it starts the process's JAX backend.)
    over = [ln for ln in summary.splitlines() if "budget" in ln]
    assert any(ln.endswith(f"{burns} ({rows[burns]:.0f} s)") for ln in over), summary
    assert not any(why in ln for ln in over), summary
