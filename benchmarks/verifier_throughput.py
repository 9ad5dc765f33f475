"""Verifier cost: sandbox overhead per run, and verifications per second on a GRPO-sized batch.

    sudo .venv/bin/python benchmarks/verifier_throughput.py [--runs 60] [--rollouts 64] [--tests 10]

1. Overhead: the median wall time of running ``/bin/true`` in the full sandbox (bubblewrap
   namespaces, mounts, seccomp, the root supervisor, rlimits, uid switch, a per-run memory cgroup)
   minus the median of a bare ``subprocess.run(["/bin/true"])``, in the same run. Target: <= 25 ms.
   With its breakdown, the cases alternating run by run so that a neighbour slows each alike:
   bubblewrap alone (the sandbox's namespaces and mounts around /bin/true, no launcher), the
   sandbox without memory cgroups and without its seccomp filter (so: the launcher's cost), then
   with the filter, with the run's cgroup joined as the run starts (how every run
   paid it before), with a fake cgroup v2 tree (the v2 code path without the kernel's work; named
   as a fake), and as it runs now (joined ahead, in the background).
2. Python's syntax check ("compilation"): the median time to compile a distinct program with
   ``verifiers.python_check="sandbox"`` (one sandbox run each, the baseline) and with the default
   "helper" (``compile()`` in a long-lived unprivileged process), in the same run.
3. Throughput: one ``verify`` call with 64 rollouts x 10 tests (distinct Python programs, so
   nothing is shared through the compile cache) on ``--workers`` sandbox slots (2 = 2 cores).

Prints a markdown table and writes JSON next to this script (``verifier_throughput.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from unittest import mock

from rlax_tpu.config import VerifierConfig
from rlax_tpu.verifiers import memory
from rlax_tpu.verifiers.api import CodeTask
from rlax_tpu.verifiers.memory import MemoryCgroups
from rlax_tpu.verifiers.outcomes import program_limits
from rlax_tpu.verifiers.problems import upload_problem
from rlax_tpu.verifiers.sandbox import Limits, Sandbox
from rlax_tpu.verifiers.service import VerifierService

SOLUTION = """import sys
# rollout {i}
data = sys.stdin.read().split()
t = int(data[0])
print("\\n".join(str(int(data[1 + 2 * k]) + int(data[2 + 2 * k])) for k in range(t)))
"""


def median_ms(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--tests", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sandbox-uid", type=int, default=500_000)
    parser.add_argument("--out", default=str(Path(__file__).with_name("verifier_throughput.json")))
    args = parser.parse_args()

    config = VerifierConfig(
        workers=args.workers, sandbox_uid=args.sandbox_uid, languages=("python", "cpp")
    )
    with (
        tempfile.TemporaryDirectory() as tmp,
        VerifierService(config, scratch_dir=Path(tmp)) as svc,
    ):
        limits = Limits(cpu_time_s=1, wall_time_s=5, memory_bytes=256 << 20, output_bytes=1 << 20)
        breakdown = overhead_breakdown(svc.sandbox, Path(tmp), args, limits)
        bare, boxed = breakdown["bare subprocess"], breakdown["sandbox (as it runs)"]

        # A Python program in the sandbox vs bare, for scale.
        probe = svc.compiler.compile("python", "print(1)\n")
        py_limits = program_limits(
            probe, time_limit_s=2, memory_mb=256, output_bytes=1 << 20, disk_bytes=64 << 20
        )
        py_bare = median_ms(
            lambda: subprocess.run(
                [
                    probe.argv(256)[0].replace("/opt/python", _prefix(svc)),
                    "-I",
                    "-S",
                    "-c",
                    "print(1)",
                ],
                check=True,
                stdout=subprocess.DEVNULL,
            ),
            args.runs,
        )
        py_boxed = median_ms(
            lambda: svc.sandbox.run(probe.argv(256), limits=py_limits, mounts=probe.mounts),
            args.runs,
        )

        counter = iter(range(10**9))
        compile_ms = {
            "helper": median_ms(
                lambda: svc.compiler.compile("python", f"print({next(counter)})\n"), args.runs
            )
        }
        boxed_config = dataclasses.replace(
            config, python_check="sandbox", sandbox_uid=args.sandbox_uid + args.workers
        )
        with VerifierService(boxed_config, scratch_dir=Path(tmp) / "boxed") as boxed_svc:
            compile_ms["sandbox"] = median_ms(
                lambda: boxed_svc.compiler.compile("python", f"print({next(counter)})\n"),
                args.runs,
            )
        tests = []
        for k in range(args.tests):
            pairs = [(k * 7 + j, 1000 - j) for j in range(50)]
            tests.append(
                (
                    f"{len(pairs)}\n" + "".join(f"{a} {b}\n" for a, b in pairs),
                    "".join(f"{a + b}\n" for a, b in pairs),
                )
            )
        problem = upload_problem(svc, problem_id="bench", tests=tests, time_limit_s=2)
        tasks = [
            CodeTask(problem=problem, language="python", code=SOLUTION.format(i=i))
            for i in range(args.rollouts)
        ]
        start = time.perf_counter()
        verdicts = svc.verify(tasks)
        elapsed = time.perf_counter() - start
        accepted = sum(v.accepted for v in verdicts)

    result = {
        "cgroups": groups_name(svc.sandbox),
        "breakdown_ms": {k: round(v, 2) for k, v in breakdown.items()},
        "bare_subprocess_ms": round(bare, 2),
        "sandbox_run_ms": round(boxed, 2),
        "sandbox_overhead_ms": round(boxed - bare, 2),
        "python_bare_ms": round(py_bare, 2),
        "python_sandboxed_ms": round(py_boxed, 2),
        "python_check_sandbox_ms": round(compile_ms["sandbox"], 2),
        "python_check_helper_ms": round(compile_ms["helper"], 3),
        "rollouts": args.rollouts,
        "tests_per_rollout": args.tests,
        "workers": args.workers,
        "cpus": os.cpu_count(),
        "accepted": accepted,
        "batch_seconds": round(elapsed, 2),
        "verifications_per_s": round(args.rollouts / elapsed, 2),
        "sandbox_runs_per_s": round(args.rollouts * args.tests / elapsed, 1),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("| measure | value |\n|---|---|")
    print(f"| bare subprocess (/bin/true), median | {bare:.1f} ms |")
    print(f"| sandboxed run (/bin/true), median | {boxed:.1f} ms |")
    print(f"| **sandbox overhead per run** (target <= 25 ms) | **{boxed - bare:.1f} ms** |")
    for name, ms in breakdown.items():
        print(f"| breakdown: {name} | {ms:.1f} ms |")
    print(f"| Python `print(1)`: bare / sandboxed | {py_bare:.1f} ms / {py_boxed:.1f} ms |")
    print(
        f"| Python syntax check: sandbox run / helper | {compile_ms['sandbox']:.1f} ms / "
        f"{compile_ms['helper']:.2f} ms ({compile_ms['sandbox'] / compile_ms['helper']:.0f}x) |"
    )
    print(
        f"| batch: {args.rollouts} rollouts x {args.tests} tests, {args.workers} workers "
        f"| {elapsed:.2f} s, {accepted}/{args.rollouts} accepted |"
    )
    print(f"| **verifications/s** | **{args.rollouts / elapsed:.2f}** |")
    print(
        f"| sandbox runs/s (tests; syntax checks run in the helper) | {result['sandbox_runs_per_s']} |"
    )


class _JoinAtRun(Sandbox):
    """The sandbox as every run paid it before: nothing made ahead, so each run makes its cgroup
    and moves its shell into it on its own path."""

    def _fill(self) -> None:
        return None


def _fake_v2_sandbox(root: Path, uid: int) -> Sandbox:
    """A sandbox whose run cgroups are made in a fake cgroup2 tree, named as such: a directory
    laid out as cgroupfs (the fake of tests/verifiers/test_memory.py), so its rows time the v2
    code path (memory.max, swap, oom.group, memory.events) without any kernel cgroup work; this
    host's memory controller is bound to cgroup v1."""
    root.mkdir(parents=True)
    files = {
        "cgroup.procs": "",
        "memory.max": "max",
        "memory.swap.max": "max",
        "memory.oom.group": "0",
        "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n",
    }
    real_mkdir, real_rmdir = memory._mkdir, memory._rmdir

    def mkdir(path: Path) -> None:
        if root not in path.parents:
            return real_mkdir(path)
        path.mkdir()
        for name, text in files.items():
            (path / name).write_text(text)

    def rmdir(path: Path) -> None:
        return shutil.rmtree(path) if root in path.parents else real_rmdir(path)

    memory._mkdir, memory._rmdir = mkdir, rmdir
    with mock.patch.object(MemoryCgroups, "detect", lambda: MemoryCgroups(root, version=2)):
        return Sandbox(uid_base=uid, slots=1, scratch_dir=root.parent / "fake_v2_scratch")


def groups_name(sandbox: Sandbox) -> str:
    groups = sandbox.memory_cgroups
    return f"v{groups.version}" if groups is not None else "none"


def overhead_breakdown(
    sandbox: Sandbox, tmp: Path, args: argparse.Namespace, limits: Limits
) -> dict[str, float]:
    """Median ms of /bin/true per way of running it, the ways alternating run by run."""
    uid = args.sandbox_uid + 2 * args.workers  # beyond the service's and the boxed check's slots
    plain = Sandbox(uid_base=uid, slots=1, scratch_dir=tmp / "plain", memory_cgroups=False)
    unfiltered = Sandbox(
        uid_base=uid + 3,
        slots=1,
        scratch_dir=tmp / "unfiltered",
        memory_cgroups=False,
        use_seccomp=False,
    )
    at_run = _JoinAtRun(uid_base=uid + 1, slots=1, scratch_dir=tmp / "at_run")
    fake_v2 = _fake_v2_sandbox(tmp / "fake_v2", uid + 2)
    bwrap = [plain._bwrap, *plain._fixed_args, "/bin/true"]
    cases = {
        "bare subprocess": lambda: subprocess.run(["/bin/true"], check=True),
        "bubblewrap alone": lambda: subprocess.run(bwrap, check=True),
        "sandbox, no memory cgroup, no seccomp filter": lambda: unfiltered.run(
            ["/bin/true"], limits=limits
        ),
        "sandbox, no memory cgroup": lambda: plain.run(["/bin/true"], limits=limits),
        "sandbox, cgroup joined at the run (before)": lambda: at_run.run(
            ["/bin/true"], limits=limits
        ),
        "sandbox, fake cgroup v2 layout (the code's path; no kernel)": lambda: fake_v2.run(
            ["/bin/true"], limits=limits
        ),
        "sandbox (as it runs)": lambda: sandbox.run(["/bin/true"], limits=limits),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for run in cases.values():  # warm the page cache
        run()
    for _ in range(args.runs):
        for name, run in cases.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    for box in (plain, unfiltered, at_run, fake_v2):
        box.close()
    return {name: statistics.median(t) * 1000 for name, t in times.items()}


def _prefix(svc: VerifierService) -> str:
    for m in svc.toolchains.mounts:
        if m.target == "/opt/python":
            return str(m.source)
    return "/opt/python"


if __name__ == "__main__":
    main()
