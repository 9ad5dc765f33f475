"""`python -m rlax_tpu.drills`: a short drill in deterministic mode that kills each kind of
component once, restarts it, and checks the run against an uninterrupted one; and the kill plan."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from rlax_tpu.drills.drill import KINDS, kind_of, plan
from tests.launch.test_local import REPO, _env, _tiny


def test_a_plan_hits_every_kind_before_any_twice_and_is_seeded():
    targets = [
        "controller",
        "trainer",
        "verifiers",
        "inference-0",
        "inference-1",
        "param_server-0",
        "param_server-1",
    ]
    kills = plan(targets, 12, seed=3)
    first = [k.kind for k in kills[:5]]
    assert sorted(first) == sorted(KINDS)
    assert (
        max(Counter(k.kind for k in kills).values()) - min(Counter(k.kind for k in kills).values())
        <= 1
    )
    assert all(kind_of(k.target) == k.kind and k.target in targets for k in kills)
    assert all(0 <= k.fraction < 1 and 0.5 <= k.restart_delay_s <= 2.0 for k in kills)
    assert plan(targets, 12, seed=3) == kills
    assert plan(targets, 12, seed=4) != kills


# The drill's own wait (900 s) sits inside this test's pytest-timeout, so a slow run fails with
# the drill's output instead of pytest's bare timeout.
@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_a_short_drill_kills_every_component_and_changes_nothing(tmp_path):
    """Five SIGKILLs, one of each kind, each restarted: every group trained exactly once, η_a
    held, final trainer state bitwise the uninterrupted run's, no partial version served, every
    checkpoint and snapshot complete; a restarted process reuses the compilation cache."""
    run_dir = tmp_path / "run"
    args = [*_tiny(run_dir, 40), "--kills=5", "--seed=1"]
    env = _env()
    env.pop("JAX_COMPILATION_CACHE_DIR")  # the run's own cache, as in production (not the tests')
    done = subprocess.run(
        [sys.executable, "-m", "rlax_tpu.drills", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = done.stdout
    assert done.returncode == 0, out[-6000:] + done.stderr[-3000:]
    report = json.loads((run_dir / "drill.json").read_text())
    assert sorted(k["kind"] for k in report["kills"]) == sorted(KINDS)
    assert all(k["recover_s"] >= 0 for k in report["kills"])
    checks = {c["name"]: c for c in report["checks"]}
    for name in (
        "every kill recovered",
        "run finished",
        "every update logged once",
        "no group lost",
        "every group trained exactly once",
        "η_a held",
        "checkpoints complete or skipped",
        "snapshots complete or skipped",
        "parameter server never served a partial version",
        "final weights bitwise equal",
        "same groups trained as the uninterrupted run",
    ):
        assert checks[name]["ok"], checks[name]
    assert "[ok] final weights bitwise equal" in out
    assert (run_dir / "drill.md").read_text().count("recovered in") == 5
    # Compiled programs went to the run's cache, which restarted processes read.
    assert any((run_dir / "drill" / "jax_cache").iterdir())

    # The checks alone, on the directories the drill left; then on a damaged copy, they fail.
    check = [
        sys.executable,
        "-m",
        "rlax_tpu.drills",
        *_tiny(run_dir, 40),
        f"--check={run_dir / 'drill'}",
        f"--reference={run_dir / 'reference'}",
    ]
    again = subprocess.run(check, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "[ok] final weights bitwise equal" in again.stdout
    final = max(
        (run_dir / "drill" / "trainer").iterdir(),
        key=lambda p: int(p.name) if p.name.isdigit() else -1,
    )
    chunk = max(
        (p for p in final.rglob("*") if p.is_file() and "state" in p.parts),
        key=lambda p: p.stat().st_size,
    )
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x01
    chunk.write_bytes(bytes(data))
    bad = subprocess.run(check, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1, bad.stdout[-3000:] + bad.stderr[-3000:]
    assert "[FAIL] final weights bitwise equal" in bad.stdout
    assert "[FAIL] checkpoints complete or skipped" in bad.stdout
