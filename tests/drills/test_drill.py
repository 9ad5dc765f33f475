"""`python -m rlax_tpu.drills`: a short drill in deterministic mode that kills each kind of
component once, restarts it, and checks the run against an uninterrupted one; and the kill plan."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from rlax_tpu.config import RunConfig
from rlax_tpu.config.convert import from_dict
from rlax_tpu.drills import drill
from rlax_tpu.drills.drill import KINDS, DrillLaunch, Kill, kind_of, plan, targets_of
from rlax_tpu.launch.local import Child, Launch
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


def _multi(run_dir: str) -> RunConfig:
    """A 2-process trainer, 2 inference workers of 3 processes, 2 parameter-server replicas."""
    return from_dict(
        RunConfig,
        {
            "controller": {"run_dir": run_dir},
            "trainer": {"distributed": {"coordinator_address": "auto", "num_processes": 2}},
            "inference": {
                "num_workers": 2,
                "distributed": {"coordinator_address": "auto", "num_processes": 3},
            },
            "param_server": {"replicas": 2},
        },
    )


def test_targets_include_each_follower_process_as_the_launcher_names_it(tmp_path):
    config = _multi(str(tmp_path))
    targets = targets_of(config)
    assert targets == [
        "controller",
        "trainer",
        "verifiers",
        "trainer.1",
        "inference-0",
        "inference-0.1",
        "inference-0.2",
        "inference-1",
        "inference-1.1",
        "inference-1.2",
        "param_server-0",
        "param_server-1",
    ]
    processes = Launch(config, [], out=io.StringIO())._plan()
    assert [t for t in targets if "." in t] == [
        n for n in processes if "." in n and not n.endswith(".0")
    ]
    assert [
        kind_of(t) for t in ("trainer.1", "inference-1.2", "param_server-1", "inference-0")
    ] == [
        "trainer",
        "inference",
        "param_server",
        "inference",
    ]
    assert Kill("inference-1.2", 0.0, 1.0).is_process
    assert Kill("inference-1.2", 0.0, 1.0).group == "inference-1"
    assert not Kill("param_server-1", 0.0, 1.0).is_process
    assert not Kill("trainer", 0.0, 1.0).is_process
    # One process per component: no process targets.
    assert targets_of(from_dict(RunConfig, {})) == [
        "controller",
        "trainer",
        "verifiers",
        "inference-0",
        "param_server-0",
    ]


def test_a_plan_draws_single_processes_among_a_kinds_targets():
    targets = ["controller", "trainer", "verifiers", "trainer.1", "inference-0", "param_server-0"]
    hit = Counter()
    for seed in range(40):
        kills = plan(targets, 5, seed)
        assert sorted(k.kind for k in kills) == sorted(KINDS)
        hit.update(k.target for k in kills if k.kind == "trainer")
    assert hit["trainer"] > 5 and hit["trainer.1"] > 5
    # The seed the short drill below uses: its trainer and inference kills are follower processes.
    short = plan(
        [
            "controller",
            "trainer",
            "verifiers",
            "trainer.1",
            "inference-0",
            "inference-0.1",
            "param_server-0",
            "param_server-1",
        ],
        5,
        0,
    )
    assert {"trainer.1", "inference-0.1"} <= {k.target for k in short}


def _sh(launch: DrillLaunch, name: str, script: str) -> Child:
    child = Child(name, ["sh", "-c", script], launch.env, launch.log_dir, io.StringIO())
    launch.services.append(child)
    return child


def test_killing_a_follower_waits_for_its_job_to_end_then_restarts_the_whole_job(tmp_path):
    """The rest of the job ends on its own (status recorded, time measured); the check holds;
    the restart brings back every process of the job, not only the killed one."""
    launch = DrillLaunch(_multi(str(tmp_path)), [], [], out=io.StringIO())
    try:
        lead = _sh(launch, "trainer.0", "sleep 0.5; exit 1")  # ends as the failure rule says
        follower = _sh(launch, "trainer.1", "sleep 60")
        other = _sh(launch, "verifiers", "sleep 60")
        kill = Kill("trainer.1", 0.0, 0.5)
        launch._kill(kill)
        assert follower.proc.returncode == -9 and lead.proc.poll() is None
        launch._await_group_end(kill)
        assert 0.3 < kill.group_end_s < 5, kill
        assert kill.outlived == [] and kill.group_exits[0].startswith("trainer.0 status 1 after")
        assert other.proc.poll() is None  # another component is untouched
        check = drill.group_end_check([kill])
        assert check.ok and "trainer.1: its job ended in" in check.detail, check
        launch._restart(kill.group)
        names = [c.name for c in launch.services]
        assert sorted(names) == ["trainer.0", "trainer.1", "verifiers"]
        assert all(c.proc.poll() is None for c in launch.services if c.name != "trainer.0")
        assert lead not in launch.services and follower not in launch.services
        assert launch.unplanned == []
    finally:
        launch.stop()


def test_a_process_that_outlives_the_bound_is_recorded_and_killed(tmp_path, monkeypatch):
    monkeypatch.setattr(drill, "GROUP_END_BOUND_S", 1.0)
    launch = DrillLaunch(_multi(str(tmp_path)), [], [], out=io.StringIO())
    try:
        stuck = _sh(launch, "inference-0.0", "sleep 60")
        _sh(launch, "inference-0.1", "sleep 60")
        _sh(launch, "inference-0.2", "sleep 0.2; exit 1")
        kill = Kill("inference-0.1", 0.0, 0.5)
        launch._kill(kill)
        launch._await_group_end(kill)
        assert kill.outlived == ["inference-0.0"] and stuck.proc.returncode == -9
        assert math.isnan(kill.group_end_s)
        check = drill.group_end_check([kill])
        assert not check.ok and "inference-0.0 outlived" in check.detail, check
        assert "outlived 1 s (SIGKILLed)" in drill.describe([kill])[0]
    finally:
        launch.stop()


def test_the_group_end_check_is_vacuous_without_a_process_kill():
    check = drill.group_end_check([Kill("trainer", 0.0, 1.0, killed_at=3.0)])
    assert check.ok and check.detail.startswith("vacuous"), check
    assert check.name == "a killed process ended its whole job within 30 s"


# A trainer and an inference worker of two jax.distributed processes each, and two
# parameter-server replicas: seed 0 plans inference-0.1 and trainer.1 (followers alone),
# controller, verifiers, param_server-0. A lead ends 5 s after its follower (the default 20 s
# bound is tests/trainer/test_process_faults.py's): the drill waits for it, and so would the suite.
TOPOLOGY = [
    "--config.param_server.replicas=2",
    "--config.trainer.distributed.coordinator_address=auto",
    "--config.trainer.distributed.num_processes=2",
    "--config.trainer.distributed.heartbeat_timeout_s=5",
    "--config.inference.distributed.coordinator_address=auto",
    "--config.inference.distributed.num_processes=2",
    "--config.inference.distributed.heartbeat_timeout_s=5",
    "--config.inference.mesh.tensor=2",
    # π_old in one prefill-shaped pass, not replayed token by token: the CPU default's replay
    # ran a collective across the trainer's two processes per token and took 2.5-3 s of a
    # 3.6 s step in each (the two took 42 of a run's 107 CPU-s, 18 with prefill). The
    # drill's claims are about kills and resumes: both runs compute π_old alike, so the bitwise
    # check is unchanged, and the replay's own claims are tests/trainer/test_alignment*.py's.
    "--config.trainer.old_logprobs=prefill",
]
# 2 x 5 kills + 1 at least (the drill refuses fewer), and three more: a kill waits for a step
# after the last recovery, and one that lands late (seen: kill 2 five steps after kill 1's
# recovery, twice in four CI runs) left the 12-step run ending before kill 5.
STEPS = 14


# Code-repair episodes: each first attempt's verdict comes back as a user turn and a second
# attempt follows, so a kill of the controller, a worker or the verifier often lands mid-episode
# (an episode in flight is played again from its first turn).
EPISODES = [
    "--config.environment.name=code_repair",
    "--config.environment.max_turns=2",
    "--config.environment.turn_tokens=16",
    "--config.data.prompt_style=chat",
    "--config.inference.max_new_tokens=160",  # two turns of 16 and the verdict's feedback
    "--config.controller.warmup_steps=0",
    # Held-out evaluations at the start and the end only (the preset adds one at step 10): a
    # kill can still land in one, and each costs both runs episodes over the 2-process worker.
    "--config.data.eval_every=0",
]


# What every drill must show, whatever its mode and topology.
COMMON_CHECKS = (
    "every kill recovered",
    "run finished",
    "every update logged once",
    "no group lost",
    "every group trained exactly once",
    "η_a held",
    "checkpoints complete or skipped",
    "snapshots complete or skipped",
)


def _drill(run_dir: Path, args: list[str], env: dict, *, timeout: int) -> tuple[str, dict, dict]:
    """Runs ``python -m rlax_tpu.drills`` with ``args`` (its run in ``run_dir``): (its stdout,
    its drill.json, its checks by name); fails the test with the drill's output if it failed."""
    done = subprocess.run(
        [sys.executable, "-m", "rlax_tpu.drills", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    report = json.loads((run_dir / "drill.json").read_text())
    return done.stdout, report, {c["name"]: c for c in report["checks"]}


def _max_turns(run_dir: Path) -> float:
    """The largest ``episode/turns_mean`` the drilled run logged."""
    turns = [
        json.loads(line)["scalars"].get("episode/turns_mean")
        for line in (run_dir / "drill" / "metrics.jsonl").read_text().splitlines()
    ]
    return max(t for t in turns if t is not None)


# The drill's own wait (900 s) sits inside this test's pytest-timeout, so a slow run fails with
# the drill's output instead of pytest's bare timeout.
@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_a_short_drill_kills_every_component_and_changes_nothing(tmp_path):
    """Five SIGKILLs, one of each kind, each restarted, over a trainer and an inference worker of
    2 jax.distributed processes each and 2 parameter-server replicas: the trainer and inference
    kills hit a follower process alone, and its lead ends on its own within 30 s (the failure
    rule) before the job restarts; one replica is killed while the other serves. Every group
    trained exactly once, η_a held, final trainer state bitwise the uninterrupted run's (same
    topology), no partial version served, every checkpoint and snapshot complete; a restarted
    process reuses the compilation cache. The rollouts are two-turn code-repair episodes.

    Cost: about 200 CPU-s, the suite's largest: an uninterrupted run and a drilled one of 14
    steps each (five kills need 11; STEPS says why more), 8 processes each with its own compiles, as the
    drill runs in production (its own cache), then two checking processes."""
    run_dir = tmp_path / "run"
    args = [*_tiny(run_dir, STEPS), *TOPOLOGY, *EPISODES, "--kills=5", "--seed=0"]
    env = _env()
    env.pop("JAX_COMPILATION_CACHE_DIR")  # the run's own cache, as in production (not the tests')
    out, report, checks = _drill(run_dir, args, env, timeout=900)
    assert sorted(k["kind"] for k in report["kills"]) == sorted(KINDS)
    assert all(k["recover_s"] >= 0 for k in report["kills"])
    targets = {k["kind"]: k for k in report["kills"]}
    assert targets["param_server"]["target"] in ("param_server-0", "param_server-1")
    # Each follower's lead ended on its own (non-zero), within the bound, before its job restarted.
    for kind, lead in (("trainer", "trainer.0"), ("inference", "inference-0.0")):
        follower = targets[kind]
        assert follower["target"] == lead[:-1] + "1", follower
        assert 0 < follower["group_end_s"] <= 30 and follower["outlived"] == [], follower
        assert follower["group_exits"][0].startswith(f"{lead} status "), follower
        assert not follower["group_exits"][0].startswith(f"{lead} status 0 "), follower
    assert report["unplanned"] == []
    for name in (
        *COMMON_CHECKS,
        "a killed process ended its whole job within 30 s",
        "parameter server never served a partial version",
        "final weights bitwise equal",
        "same groups trained as the uninterrupted run",
    ):
        assert checks[name]["ok"], checks[name]
    assert "[ok] final weights bitwise equal" in out
    ended = checks["a killed process ended its whole job within 30 s"]["detail"]
    assert "trainer.1: its job ended in" in ended and "inference-0.1: its job ended in" in ended
    assert (run_dir / "drill.md").read_text().count("recovered in") == 5
    assert _max_turns(run_dir) > 1.0  # the episodes had second turns
    # Compiled programs went to the drill's one cache (the reference's and the drilled run's),
    # which restarted processes read.
    assert any((run_dir / "jax_cache").iterdir())
    assert not (run_dir / "drill" / "jax_cache").exists()

    # The checks alone, on the directories the drill left; then on a damaged copy, they fail.
    check = [
        sys.executable,
        "-m",
        "rlax_tpu.drills",
        *_tiny(run_dir, STEPS),
        *TOPOLOGY,
        *EPISODES,
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


def _seed_killing(kinds: set[str], targets: list[str]) -> int:
    """The first drill seed whose plan of len(kinds) kills hits exactly ``kinds``."""
    return next(s for s in range(1000) if {k.kind for k in plan(targets, len(kinds), s)} == kinds)


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_a_throughput_drill_with_episodes_loses_and_repeats_nothing(tmp_path):
    """Two-turn code-repair episodes in throughput mode, played one by one, under a SIGKILL of the
    controller and one of the inference worker (the two that hold episodes mid-turn): every kill
    recovered, no group lost, every group trained exactly once, η_a held, checkpoints and
    snapshots complete. Throughput mode has no reference run to compare bits with (the
    deterministic drill above does); single-process components and 5 steps keep it at about a
    third of that drill's cost."""
    run_dir = tmp_path / "run"
    seed = _seed_killing(
        {"controller", "inference"},
        ["controller", "trainer", "verifiers", "inference-0", "param_server-0"],
    )
    args = [*_tiny(run_dir, 5), *EPISODES, "--kills=2", f"--seed={seed}", "--mode=throughput"]
    _, report, checks = _drill(run_dir, args, _env(), timeout=600)
    assert sorted(k["kind"] for k in report["kills"]) == ["controller", "inference"]
    for name in COMMON_CHECKS:
        assert checks[name]["ok"], checks[name]
    assert "final weights bitwise equal" not in checks  # no reference in throughput mode
    assert _max_turns(run_dir) > 1.0
