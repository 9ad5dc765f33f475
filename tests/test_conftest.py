import os
import subprocess
import sys
from pathlib import Path

import jax

REPO = Path(__file__).resolve().parents[1]


def test_eight_cpu_devices_for_sharding_tests():
    assert jax.device_count() == 8
    assert {d.platform for d in jax.devices()} == {"cpu"}


def test_the_cpu_log_counts_each_tests_own_and_its_childrens_cpu(tmp_path):
    (tmp_path / "test_burn.py").write_text(
        "import subprocess, sys\n"
        "def test_idle():\n    pass\n"
        "def test_child_burns():\n"
        "    subprocess.run([sys.executable, '-c', 'sum(range(30_000_000))'], check=True)\n"
    )
    log = tmp_path / "cpu.tsv"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", str(tmp_path)],
        cwd=REPO,
        env=os.environ | {"RLAX_TEST_CPU_LOG": str(log)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # Node ids are relative to the rootdir pytest picks, which depends on where tmp_path is.
    rows = {
        node.rsplit("/", 1)[-1]: cpu
        for cpu, node in (line.split("\t") for line in log.read_text().splitlines())
    }
    assert sorted(rows) == ["test_burn.py::test_child_burns", "test_burn.py::test_idle"]
    # The child's loop is CPU the worker itself never spent: it is counted.
    assert float(rows["test_burn.py::test_child_burns"]) > float(rows["test_burn.py::test_idle"])
