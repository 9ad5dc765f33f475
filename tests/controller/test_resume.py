"""The main command end to end, as a user runs it: reproducibility, SIGKILL and resume, snapshots.

Every run is a real ``python -m rlax_tpu.controller`` process (local transport: parameter server on
127.0.0.1, trainer, inference worker and sandboxed verifier in that process) on a very small model.
"""

from __future__ import annotations

import collections
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rlax_tpu.controller.snapshots import SnapshotStore, full_ledger
from rlax_tpu.observability.metrics import read_metrics
from tests.child_env import child_env
from tests.environments.flaky_kinds import kind
from tests.observability.test_wandb_sink import offline_env
from tests.observability.traces import traced_programs
from tests.observability.wandb_records import history

REPO = Path(__file__).resolve().parents[2]
# A uid block of its own (tests/verifiers, tests/data and test_tasks use others).
UID = 1_400_000 + (os.getpid() % 100_000) * 8
SMALL = [
    "--config=configs/codeforces.py:local",
    "--config.model.hidden_size=64",
    "--config.model.intermediate_size=128",
    "--config.model.num_layers=2",
    "--config.model.num_heads=2",
    "--config.model.num_kv_heads=1",
    "--config.controller.prompts_per_step=2",
    "--config.algorithm.group_size=2",
    "--config.inference.max_new_tokens=16",
    "--config.inference.max_concurrent_seqs=8",
    "--config.trainer.micro_batch_size=4",
    "--config.data.eval_problems=2",
    "--config.data.eval_samples=2",
    "--config.verifiers.workers=1",
    f"--config.verifiers.sandbox_uid={UID}",
    "--config.controller.warmup_steps=3",
    "--config.controller.warmup_batch_size=4",
    "--config.trainer.learning_rate=1e-4",  # pinned: a test below names it
]
SHA = re.compile(r"final weights sha256: ([0-9a-f]{64})")
# Programs a traced update runs, as JAX names their calls in a trace (PjitFunction(<name>)).
PROGRAMS = {"trainer": {"_accumulate"}, "inference": {"decode_program", "prefill_program"}}


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    # The test run's compilation cache (tests/conftest.py) is in os.environ.
    # One CPU device: the topology every run here shares.
    return child_env(PYTHONUNBUFFERED="1")


def command(run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rlax_tpu.controller",
        *SMALL,
        f"--config.controller.run_dir={run_dir}",
        *extra,
    ]


def run(env, run_dir: Path, *extra: str, stderr: bool = False) -> str:
    """The run's stdout (and its stderr after it, with ``stderr``)."""
    out = subprocess.run(
        command(run_dir, *extra), cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout + (out.stderr if stderr else "")


def started(env, run_dir: Path, *extra: str, after_step: int) -> subprocess.Popen:
    """A run started and read until it logged ``after_step`` steps (stdout and stderr joined)."""
    proc = subprocess.Popen(
        command(run_dir, *extra),
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    for line in proc.stdout:
        if line.startswith(f"step {after_step}/"):
            break
    return proc


def killed_at_random(env, run_dir: Path, *extra: str, after_step: int, seed: int) -> None:
    """Starts a run and SIGKILLs it at a random moment after ``after_step`` steps are logged, and
    before the next one is: a warm cache makes this small model's steps take well under a second,
    and a fixed delay once landed after the last step (the resume then had nothing to resume)."""
    proc = started(env, run_dir, *extra, after_step=after_step)
    next_logged = threading.Event()

    def watch() -> None:
        for line in proc.stdout:
            if line.startswith(f"step {after_step + 1}/"):
                next_logged.set()

    reader = threading.Thread(target=watch, daemon=True)
    reader.start()
    try:
        next_logged.wait(timeout=random.Random(seed).uniform(0.0, 1.5))
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)


def sha(stdout: str) -> str:
    m = SHA.search(stdout)
    assert m, stdout[-2000:]
    return m.group(1)


def final_payload(run_dir: Path) -> dict:
    """The newest snapshot's state, with the run's whole ledger (finished groups are in
    segments beside the snapshots)."""
    latest = SnapshotStore(run_dir / "snapshots", keep=3).latest()
    assert latest is not None
    payload = json.loads(latest[1]["json"])
    return payload | {"ledger": full_ledger(run_dir, payload)}


@pytest.fixture(scope="module")
def reference(env, tmp_path_factory) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("det") / "a"
    out = run(env, run_dir, "--config.controller.num_steps=4")
    assert "run finished: 4 updates" in out
    report = (run_dir / "report.md").read_text()
    assert "a supervised warm-up of 3 steps" in report and "eval/pass@1" in report
    for plot in ("learning", "staleness", "tokens_per_s", "verdicts", "step_time"):
        assert (run_dir / "plots" / f"{plot}.png").exists(), plot
    return run_dir, sha(out)


def test_deterministic_mode_is_bitwise_reproducible(env, reference, tmp_path):
    """Also with two parameter-server replicas feeding two workers (worker i reads replica i) and
    the trainer in a spawned child behind gRPC (controller.trainer_process): where weights
    travel, how the work is split and where the trainer runs change no bit; the child is gone
    when the command returns. Update 3 is traced (observability.profile_steps) by both
    processes: the trainer's trace holds its update's programs, the workers' their decoding."""
    _, digest = reference
    out = run(
        env,
        tmp_path / "b",
        "--config.controller.num_steps=4",
        "--config.param_server.replicas=2",
        "--config.inference.num_workers=2",
        "--config.controller.trainer_process=true",
        "--config.observability.profile_steps=(3,)",
    )
    assert re.search(r"param_server 127\.0\.0\.1:\d+, 127\.0\.0\.1:\d+,", out), out[-2000:]
    child = re.search(r"trainer 127\.0\.0\.1:\d+ \(child process (\d+)\)", out)
    assert child, out[-2000:]
    assert sha(out) == digest
    traced = {p.name: p for p in (tmp_path / "b" / "profiles" / "step_000003").iterdir()}
    assert len(traced) == 2 and any(name.endswith(f".{child.group(1)}") for name in traced)
    for name, where in traced.items():
        component = "trainer" if name.endswith(f".{child.group(1)}") else "inference"
        assert json.loads((where / "components.json").read_text()) == {"components": [component]}
        programs = traced_programs(where)
        assert PROGRAMS[component] <= programs, (component, sorted(programs))
    # Gone (a zombie's cmdline is empty; a pid taken since is another command's).
    cmdline = Path(f"/proc/{child.group(1)}/cmdline")
    assert not cmdline.exists() or b"rlax_tpu" not in cmdline.read_bytes()


def test_a_finished_run_is_left_alone(env, reference):
    run_dir, _ = reference
    out = run(env, run_dir, "--config.controller.num_steps=4")
    assert "already finished 4 steps; nothing to do" in out


def test_a_finished_run_without_its_report_gets_one(env, reference, tmp_path):
    """A kill after the final snapshot, before the report: the next invocation writes it."""
    import shutil

    run_dir = tmp_path / "finished"
    shutil.copytree(reference[0], run_dir)
    (run_dir / "report.md").unlink()
    out = run(env, run_dir, "--config.controller.num_steps=4")
    assert "already finished 4 steps" in out and "run finished: 4 updates (version 4)" in out
    report = (run_dir / "report.md").read_text()
    assert "eval/pass@1" in report and "written by a later invocation" in report


def test_a_corrupt_newest_checkpoint_is_skipped_and_the_run_is_redone_bitwise(
    env, reference, tmp_path
):
    """A byte flipped in the newest trainer checkpoint (4): the resume finds it by its
    checksums, removes it, takes snapshot 3 and redoes update 4 to the same weights."""
    import shutil

    from tests.trainer.test_checkpoint import _flip_a_byte

    run_dir = tmp_path / "corrupt"
    shutil.copytree(reference[0], run_dir)
    _flip_a_byte(run_dir / "trainer" / "4", seed=0)
    out = run(env, run_dir, "--config.controller.num_steps=4")
    assert "needs trainer checkpoint 4, which is corrupt and was removed" in out, out[-3000:]
    assert "resuming" in out and "at step 3" in out
    assert sha(out) == reference[1]


def test_a_dead_trainer_ends_the_run_with_one_line_naming_it(env, tmp_path):
    """The trainer's child process killed mid-run: the controller stops with one line naming
    the trainer and its endpoint (it used to end in a page of gRPC traceback)."""
    errors = tmp_path / "stderr.txt"
    with errors.open("w") as err:
        proc = subprocess.Popen(
            command(
                tmp_path / "run",
                "--config.controller.trainer_process=true",
                "--config.controller.num_steps=1000",
            ),
            cwd=REPO,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=err,
        )
        try:
            endpoint = pid = None
            for line in proc.stdout:
                if m := re.search(r"trainer (127\.0\.0\.1:\d+) \(child process (\d+)\)", line):
                    endpoint, pid = m.group(1), int(m.group(2))
                if line.startswith("step 1/"):
                    break
            assert pid is not None, errors.read_text()[-3000:]
            os.kill(pid, signal.SIGKILL)
            proc.stdout.read()
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    stderr = errors.read_text()
    assert proc.returncode == 1, stderr[-3000:]
    assert f"rlax_tpu.controller: error: trainer at {endpoint} stopped answering (" in stderr
    assert "Traceback" not in stderr, stderr[-3000:]


def test_an_incompatible_config_is_refused_naming_the_field(env, reference):
    """Read from the newest snapshot before the components are built."""
    run_dir, _ = reference
    out = subprocess.run(
        command(run_dir, "--config.controller.num_steps=4", "--config.trainer.learning_rate=0.5"),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1
    assert "trainer.learning_rate (run: 0.0001, now: 0.5)" in out.stderr
    # Refused before any component was built (no model loaded: minutes at pod scale).
    assert "run directory" in out.stdout and "components:" not in out.stdout, out.stdout


def test_a_truncated_newest_snapshot_is_skipped_with_a_warning(env, reference, tmp_path):
    import shutil

    run_dir = tmp_path / "copy"
    shutil.copytree(reference[0], run_dir)
    store = SnapshotStore(run_dir / "snapshots", keep=3)
    newest = store.path(store.latest_step())
    newest.write_bytes(newest.read_bytes()[:100])
    out = run(env, run_dir, "--config.controller.num_steps=5")
    assert "skipping unreadable snapshot 4" in out
    assert "resuming" in out and "run finished: 5 updates" in out


def test_throughput_mode_killed_and_resumed_loses_and_duplicates_nothing(env, tmp_path):
    run_dir = tmp_path / "tp"
    extra = (
        "--config.controller.mode=throughput",
        "--config.controller.num_steps=5",
        "--config.controller.acceptance_staleness=1",
    )
    killed_at_random(env, run_dir, *extra, after_step=2, seed=3)
    before = final_payload(run_dir)["counters"]["tokens_generated"]
    out = run(env, run_dir, *extra)
    assert "run finished: 5 updates" in out
    payload = final_payload(run_dir)
    # Counters survive the resume: the rerun adds its tokens to those counted before the kill.
    assert payload["counters"]["tokens_generated"] > before > 0
    groups = {g["key"]: g for g in payload["ledger"]}
    trained = [g for g in groups.values() if g["state"] == "trained"]
    assert len(trained) == 5 * 2  # B groups per update, each trained once (keys are unique)
    for g in groups.values():
        if g["state"] == "trained":
            assert 0 <= g["trained_at"] - g["version"] <= 1  # η_a held
        if g["state"] == "discarded" and g["reason"] == "stale":
            assert g["replaced_by"] in groups  # re-issued, never lost
    # Every prompt the mixture issued is in the ledger (first issues carry no ~retry suffix).
    originals = [k for k in groups if "~" not in k]
    skipped = payload["counters"]["prompts_too_long"]
    assert len(originals) + skipped == payload["mixture"]["issued"]


@pytest.mark.slow
def test_a_gs_lora_run_killed_and_resumed_gives_the_local_runs_weights(env, gcs_emulator, tmp_path):
    """Run directory (snapshots, metrics, report, tokenizer, the warmed-up base), trainer
    checkpoints (Orbax) and the data on gs:// — a real GCS server on 127.0.0.1 (the parameter
    server's gs:// persistence is tests/param_server/test_persistence.py) — killed mid-run and
    resumed: the same final weights as an uninterrupted run with everything local, and nothing
    written to a local ./gs: folder. The run trains LoRA adapters (the base frozen): a version
    is the adapters alone, and the resumed run loads the warmed-up base its checkpoints do not
    hold from the run directory.

    Cost: about 50-65 CPU-s: three controller processes (the local reference, the gs:// run
    killed, its resume), each with its warm-up, through the GCS server; one run on gs:// cannot
    show it resumes to the local run's weights."""
    import uuid

    from rlax_tpu import storage

    from ..conftest import GCS_BUCKET
    from ..data.test_loaders import code_contests_record

    base = f"gs://{GCS_BUCKET}/resume-{uuid.uuid4().hex[:8]}"
    local_data = tmp_path / "data"
    local_data.mkdir()
    files = {
        "train-00000-of-00001.jsonl": [code_contests_record(f"{i}_A. s{i}") for i in range(4)],
        "valid-00000-of-00001.jsonl": [code_contests_record("9_B. v")],
    }
    for name, records in files.items():
        text = "".join(json.dumps(r) + "\n" for r in records)
        (local_data / name).write_text(text)
        storage.write_atomic(f"{base}/data/{name}", text)
    common = (
        "--config.controller.num_steps=3",
        "--config.model.lora_rank=4",
        "--config.data.datasets=('procedural','code_contests')",
        "--config.data.weights=(0.5,0.5)",
    )
    local = run(env, tmp_path / "local", *common, f"--config.data.data_dir={local_data}")
    genv = env | {"STORAGE_EMULATOR_HOST": gcs_emulator, "TENSORSTORE_GCS_HTTP_URL": gcs_emulator}
    run_dir = f"{base}/run"
    extra = (*common, f"--config.data.data_dir={base}/data")
    remote = storage.path(run_dir)
    # Killed at a random moment once a snapshot is on GCS (uploads there take a while).
    proc = started(genv, run_dir, *extra, after_step=1)
    watchdog = threading.Timer(600, proc.kill)  # a hung run fails the test instead of CI
    watchdog.start()
    try:
        assert proc.poll() is None, "the run ended before its first step"
        deadline = time.monotonic() + 120
        while not ((remote / "snapshots").exists() and any((remote / "snapshots").iterdir())):
            assert time.monotonic() < deadline and proc.poll() is None, "no snapshot on GCS"
            time.sleep(0.2)
        time.sleep(random.Random(11).uniform(0.0, 1.5))
        proc.send_signal(signal.SIGKILL)
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait(timeout=60)
    assert not (remote / "report.md").exists()  # it died mid-run
    assert any((remote / "trainer").iterdir())
    out = run(genv, run_dir, *extra)
    assert "resuming" in out and "run finished: 3 updates" in out, out[-3000:]
    assert sha(out) == sha(local)
    for name in (
        "report.md",
        "plots/learning.png",
        "tokenizer/tokenizer.json",
        "warmup_base/config.json",
    ):
        assert (remote / name).exists(), name

    def steps(run_dir) -> list[tuple[int, bool]]:  # noqa: ANN001
        return sorted((r["step"], "eval/pass@1" in r["scalars"]) for r in read_metrics(run_dir))

    # Each record once, as the uninterrupted run logged them (the records after the snapshot
    # that the killed run wrote were dropped on resume). Sorted: an evaluation runs beside
    # training, so its record comes when it finishes, among the updates' in either run.
    assert steps(run_dir) == steps(tmp_path / "local")
    assert (remote / "metrics" / "000001-resume.json").exists()  # the resumed writer's marker
    assert not (REPO / "gs:").exists()


def test_sigterm_then_sigkill_each_resumed_gives_the_uninterrupted_weights(
    env, reference, tmp_path
):
    """SIGTERM mid-run (a drained node, kubectl delete): the step in flight is abandoned, the
    components close, the process exits 143 with a message saying how to resume. The same
    command resumes; SIGKILLed at a random moment after step 2 (a lost node), it resumes again
    and finishes with the uninterrupted run's weights, every group trained once. (One run for
    both kinds of stop: each start costs the suite a process and its compiles.) After the
    SIGTERM it evaluates every version beside training (data.eval_every may change on resume;
    the reference evaluates 0 and 4 only), so the SIGKILL lands among evaluations in flight:
    they change no bit of training, and the evaluations of versions 0 and 4 give the
    reference's results.

    Its metrics go to W&B (offline) and to a plugin's sink that raises on its second record:
    each start continues the same W&B run, whose steps hold metrics.jsonl's training scalars;
    the failing sink is dropped with a warning and changes nothing.

    Cost: about 70 CPU-s, three starts of the main command (each its imports, W&B's included,
    and its compiles from the cache); one test for both kinds of stop and the W&B resume."""
    run_dir = tmp_path / "stopped"
    env = env | offline_env(tmp_path / "home")
    extra = (
        "--config.controller.num_steps=4",
        "--config.algorithm.plugins=('tests.observability.plugin_sinks',)",
        "--config.observability.sinks=('tensorboard','wandb','exploding')",
    )
    proc = started(env, run_dir, *extra, after_step=1)
    watchdog = threading.Timer(600, proc.kill)
    watchdog.start()
    try:
        assert proc.poll() is None, "the run ended before its first step"
        proc.send_signal(signal.SIGTERM)
        rest = proc.stdout.read()
        proc.wait(timeout=120)
    finally:
        watchdog.cancel()
        proc.kill()
    assert proc.returncode == 143, rest[-3000:]
    assert "stopped by SIGTERM; the same command resumes the run" in rest, rest[-3000:]
    assert "Traceback" not in rest and not (run_dir / "report.md").exists()
    assert "still running" not in rest  # it stopped within controller.stop_grace_s
    extra = (*extra, "--config.data.eval_every=1")
    killed_at_random(env, run_dir, *extra, after_step=2, seed=7)
    assert not (run_dir / "report.md").exists()  # it really died mid-run
    out = run(env, run_dir, *extra, stderr=True)
    assert "resuming" in out and "run finished: 4 updates" in out, out[-3000:]
    assert out.count("metric sink 'exploding' failed (log: ConnectionError") == 1, out[-3000:]
    # The restarted in-process parameter server is empty: the versions the resumed steps need
    # are republished from the trainer's checkpoints.
    assert "(the parameter server does not have it)" in out, out[-3000:]
    assert "leasing versions" not in out, out[-3000:]  # only versions it generates with
    assert sha(out) == reference[1]
    trained = [g for g in final_payload(run_dir)["ledger"] if g["state"] == "trained"]
    assert len(trained) == 4 * 2 and len({g["key"] for g in trained}) == len(trained)

    def evals(run_dir: Path) -> dict[int, list[dict]]:
        out = collections.defaultdict(list)
        for r in read_metrics(run_dir):
            if "eval/pass@1" in r["scalars"]:  # the results, not their timing
                out[r["step"]].append({k: v for k, v in r["scalars"].items() if k[:5] == "eval/"})
        return out

    want, got = evals(reference[0]), evals(run_dir)
    assert sorted(want) == [0, 4] and {0, 4} <= set(got)
    for version, records in got.items():  # a result logged again after a resume is the same
        assert all(r == records[0] for r in records), (version, records)
    for version in (0, 4):
        assert got[version][0]["eval/pass@1"] == want[version][0]["eval/pass@1"]
        assert got[version][0]["eval/problems"] == want[version][0]["eval/problems"]

    # One W&B run over the three starts, its steps with every scalar metrics.jsonl has, and the
    # same values where deterministic mode makes a step done again log the same (a start that
    # redid a step logged it again offline; syncing, W&B keeps the first).
    run_id = json.loads((run_dir / "wandb_run.json").read_text())["id"]
    starts = sorted(run_dir.glob("wandb/offline-run-*"))
    assert len(starts) == 3 and all(p.name.endswith(f"-{run_id}") for p in starts), starts
    logged = collections.defaultdict(dict)
    for rid, step, row in history(run_dir):
        assert rid == run_id
        logged[step].update(row)
    # A SIGKILL loses what W&B's service had not written yet; the SIGTERMed start closed its
    # W&B run (step 1) and the last start logged the last step.
    assert {1, 4} <= set(logged), sorted(logged)
    for record in read_metrics(run_dir):
        if "eval/pass@1" in record["scalars"] or record["step"] not in logged:
            continue  # evaluations: at a later step
        step = logged[record["step"]]
        assert {k for k, v in record["scalars"].items() if v is not None} <= set(step)
        for k in ("reward/mean", "rollout/length_mean", "trainer/loss", "trainer/grad_norm"):
            assert step[k] == record["scalars"][k], (record["step"], k)


def test_an_environment_that_raises_or_hangs_is_cut_and_the_run_resumes_through_it(env, tmp_path):
    """A plugin environment raising at the first reply to some problems and hanging at others'
    (tests/environments/plugin_flaky.py): those episodes are cut (environment.timeout_s bounds
    the hang) and counted, their groups left out, and the run finishes; SIGKILLed mid-run and
    resumed, it meets the same failures again and finishes again."""
    run_dir = tmp_path / "flaky"
    extra = (
        "--config.controller.num_steps=4",
        "--config.algorithm.plugins=('tests.environments.plugin_flaky',)",
        "--config.environment.name=flaky",
        "--config.environment.max_turns=2",
        "--config.environment.turn_tokens=8",
        "--config.environment.timeout_s=1",
        "--config.data.prompt_style=chat",
        "--config.inference.max_new_tokens=64",
        "--config.controller.warmup_steps=0",
        "--config.data.eval_every=0",
        "--config.controller.prompts_per_step=4",
        "--config.trainer.micro_batch_size=8",
    )
    killed_at_random(env, run_dir, *extra, after_step=2, seed=11)
    assert not (run_dir / "report.md").exists()
    out = run(env, run_dir, *extra, stderr=True)
    assert "resuming" in out and "run finished: 4 updates" in out, out[-3000:]
    # The groups left out are exactly those of the problems the environment fails on, and the
    # seeded draw holds both kinds (16 problems, 1 raising and 3 hanging).
    ledger = final_payload(run_dir)["ledger"]
    problem = {g["key"]: g["key"].split("/", 1)[1].split("#")[0] for g in ledger}
    failed = {problem[g["key"]] for g in ledger if g.get("reason") == "verifier_failed"}
    fails = {p for p in problem.values() if kind(p) != "answers"}
    assert failed == fails and {kind(p) for p in fails} == {"raises", "hangs"}, (failed, fails)
    steps = [r["scalars"] for r in read_metrics(run_dir) if "episode/turns_mean" in r["scalars"]]
    assert len(steps) == 4
    counted = sum(
        st["episode/environment_errors"] + st["episode/environment_timeouts"] for st in steps
    )
    assert counted > 0  # (those of the killed run after its last snapshot went with it)


def test_an_algorithm_of_the_users_own_trains_from_the_main_command(env, tmp_path):
    """The open registry end to end: a plugin module named in the config registers an algorithm
    with its own advantage estimator (tests/algorithms/plugin_rank.py), and the main command
    trains with it."""
    run_dir = tmp_path / "plugin"
    out = run(
        env,
        run_dir,
        "--config.controller.num_steps=2",
        "--config.algorithm.name=rank_grpo",
        "--config.algorithm.plugins=('tests.algorithms.plugin_rank',)",
    )
    assert "run finished: 2 updates" in out, out[-2000:]
    report = (run_dir / "report.md").read_text()
    assert '"name": "rank_grpo"' in report and "tests.algorithms.plugin_rank" in report
