"""The entry points, run as users run them: ``python -m rlax_tpu.<component>``."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from rlax_tpu.cli import EXIT_USAGE, unknown_override

REPO = Path(__file__).resolve().parents[1]
COMPONENTS = ["controller", "param_server", "inference", "verifiers", "trainer", "aot", "plan"]
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


def test_a_publish_dtype_the_workers_would_refuse_is_a_config_error_at_start():
    """[pod-fidelity]: a run publishing bf16 to float32 workers used to start, then have every
    worker refuse version 1 (InvalidWeights) and be marked down in turn."""
    out = run("controller", LOCAL, "--config.trainer.publish_dtype=bfloat16")
    assert out.returncode == EXIT_USAGE, out.stderr[-2000:]
    assert (
        "config error: trainer.publish_dtype = 'bfloat16': the workers hold model.param_dtype "
        "'float32' and would refuse every version published as 'bfloat16'"
    ) in out.stderr
    # Agreeing dtypes run, and a LoRA run publishes float32 adapters whatever it says.
    for agree in (
        ["--config.trainer.publish_dtype=float32"],
        ["--config.trainer.publish_dtype=bfloat16", "--config.model.lora_rank=4"],
    ):
        ok = run("controller", LOCAL, *agree, "--print_config")
        assert ok.returncode == 0, ok.stderr[-2000:]


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


@pytest.mark.parametrize(
    "flags, why",
    [
        (["--evaluate="], "names no dataset"),  # e.g. an empty shell variable: never a training
        (["--evaluate=human_eval,"], "names no dataset"),
        (["--evaluate=human_eval", "--warmup_out=/tmp/x"], "do not go together"),
        (["--evaluate_sample=8"], "needs --evaluate"),  # would train: the count says otherwise
        (["--evaluate=human_eval", "--evaluate_sample=-1"], "a count >= 0"),
    ],
)
def test_controller_refuses_an_evaluate_that_names_nothing(flags, why, tmp_path):
    out = run("controller", LOCAL, f"--config.controller.run_dir={tmp_path / 'run'}", *flags)
    assert out.returncode == EXIT_USAGE and why in out.stderr, out.stderr
    assert not (tmp_path / "run").exists()


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


# -- JAX's persistent compilation cache ----------------------------------------------------------

# One process of a run: points the cache where the CLI does, says as which jax.distributed rank
# (what jax.distributed.initialize sets), compiles one program, and prints the cache directory and
# its entries before and after (listed afresh: no stale listing from an earlier process), and how
# many programs it read from the cache instead of compiling them.
CACHE_PROBE = """
import dataclasses, sys
import jax, jax.numpy as jnp
from jax._src import distributed, monitoring
from rlax_tpu import cli, storage
from rlax_tpu.config import RunConfig

rank, run_dir, k = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
distributed.global_state.process_id = rank
c = RunConfig()
c = dataclasses.replace(c, controller=dataclasses.replace(c.controller, run_dir=run_dir))
where = cli.use_compilation_cache(c)

def entries():
    p = storage.path(where)
    return len(list(p.iterdir())) if p.exists() else 0

hits = []
monitoring.register_event_listener(
    lambda event, **_: hits.append(event) if event.endswith("/cache_hits") else None
)
before = entries()
jax.jit(lambda x: x * k + 1)(jnp.ones(3)).block_until_ready()
print(where, before, entries(), len(hits))
"""


def _compile_once(rank: int, run_dir: str, k: float) -> tuple[str, int, int, int]:
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    done = subprocess.run(
        [sys.executable, "-c", CACHE_PROBE, str(rank), run_dir, str(k)],
        cwd=REPO,
        env={**env, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    where, before, after, hits = done.stdout.split()[-4:]
    return where, int(before), int(after), int(hits)


def test_the_compilation_cache_is_the_run_dirs_also_on_gcs(monkeypatch):
    from rlax_tpu.cli import CACHED_COMPONENTS, compilation_cache_dir
    from rlax_tpu.config import RunConfig

    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    c = RunConfig()
    on_gcs = dataclasses.replace(
        c, controller=dataclasses.replace(c.controller, run_dir="gs://b/runs/x/")
    )
    assert compilation_cache_dir(on_gcs) == "gs://b/runs/x/jax_cache"
    off = dataclasses.replace(
        on_gcs, controller=dataclasses.replace(on_gcs.controller, compilation_cache=False)
    )
    assert compilation_cache_dir(off) == ""
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "gs://shared/jax")
    assert compilation_cache_dir(on_gcs) == "gs://shared/jax"
    # Every component that compiles; the GKE render's pods all run with a gs:// run_dir
    # (tests/launch/test_gke.py checks their flags).
    assert set(CACHED_COMPONENTS) == {"controller", "trainer", "inference"}


def test_jax_reads_and_writes_the_cache_on_gs_and_only_rank_0_writes(gcs_emulator):
    """JAX's docs/persistent_compilation_cache.md: a gs:// cache works with etils installed, and
    with several processes "only the process with rank 0 in the global communication group will
    write to the persistent cache", every one reading it. On a real GCS server (the emulator):
    rank 1 compiles without writing, rank 0 writes, and a later process finds the entry."""
    from .conftest import GCS_BUCKET

    run_dir = f"gs://{GCS_BUCKET}/{uuid.uuid4().hex[:8]}/run"
    where, before, after, hits = _compile_once(1, run_dir, 3.0)
    assert where == f"{run_dir}/jax_cache" and (before, after, hits) == (0, 0, 0)
    _, before, after, hits = _compile_once(0, run_dir, 3.0)
    assert before == 0 and after > 0 and hits == 0
    # The same programs again (a restarted process): each read from gs://, nothing written. (A
    # rank-1 reader cannot be faked in one process: its programs' compile options differ from a
    # real rank 1's, so their keys do; tests/trainer/test_service.py runs a real two-process job
    # with the cache on.)
    assert _compile_once(0, run_dir, 3.0)[1:] == (after, after, after)
