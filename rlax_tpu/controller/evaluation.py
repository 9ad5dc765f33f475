"""Held-out evaluations beside training: started when due, logged against their version when done.

An evaluation of version v no longer stops the controller: it is started (``start``) and runs on
its own thread, one evaluation after another in version order, while the controller goes on
issuing, consuming and training; the controller takes finished ones (``take_done``) between
steps and logs each against v. Its generation goes through the same worker pool as training
(its requests are not counted in the pool's load balance, so training's assignment of requests
to workers stays what it was) in chunks of at most ``data.eval_share`` of the workers' sequence
slots (throughput mode; a chunk fills them in deterministic mode); outside deterministic mode a
chunk joins its version's epoch on a worker ahead of newer versions' (``WorkerPool.submit``'s
``ahead``), so evaluating a version training has moved past does not reload a worker back to it.
The version being evaluated is leased as its own consumer until the evaluation ends.

A run killed with evaluations in flight lists them in its snapshot (``evals_in_flight``, from
``pending``); the resumed run takes a result its metrics already hold, and evaluates the others
again. ``EvaluationMixin`` holds the Controller's side: what is due, how a version is evaluated
(pass@k over the held-out problems, episodes played where an environment is set), the logging.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlax_tpu import storage
from rlax_tpu.controller import groups as groups_lib
from rlax_tpu.data.evaluation import mean_pass_at_k
from rlax_tpu.data.problems import Problem
from rlax_tpu.observability.metrics import MetricsWriter, read_metrics
from rlax_tpu.observability.progress import Progress

log = logging.getLogger(__name__)

EVAL_LEASE = "evaluation"  # the parameter-server consumer an evaluation beside training leases as
EVAL_DIR = "eval"  # <run_dir>/eval/version_<v>.jsonl: every held-out sample of the eval at v


def problems_at_once(share: float, workers: int, slots: int, samples: int) -> int:
    """Held-out problems an evaluation sends at a time: ``share`` of every worker's ``slots``
    sequence slots, at ``samples`` sequences a problem (at least one problem)."""
    return max(1, math.floor(share * workers * slots / samples))


class BackgroundEvals:
    """Evaluations of versions by ``evaluate(version) -> metrics``, one thread, version order."""

    def __init__(self, evaluate: Callable[[int], dict[str, float]]):
        self._evaluate = evaluate
        self._executor = cf.ThreadPoolExecutor(1, "eval")
        self._running: dict[int, cf.Future[dict[str, float]]] = {}
        self._lock = threading.Lock()

    def start(self, version: int) -> None:
        with self._lock:
            if version not in self._running:
                self._running[version] = self._executor.submit(self._evaluate, version)

    def pending(self) -> list[int]:
        """Versions started and not yet taken, ascending."""
        with self._lock:
            return sorted(self._running)

    def wait(self) -> None:
        """Returns once every evaluation started has finished (or failed)."""
        with self._lock:
            running = list(self._running.values())
        cf.wait(running)

    def take_done(self, *, wait: bool = False) -> list[tuple[int, dict[str, float]]]:
        """(version, metrics) of the finished evaluations, ascending, each once; ``wait``: of
        every one started. An evaluation that failed raises here, once the ones before it
        were taken (it stays, and raises again)."""
        if wait:
            self.wait()
        with self._lock:
            running = dict(self._running)
        out = []
        for version in sorted(running):
            fut = running[version]
            if not fut.done():
                continue
            if fut.exception() is not None and out:
                break  # the finished ones first; this one raises at the next call
            metrics = fut.result()
            with self._lock:
                del self._running[version]
            out.append((version, metrics))
        return out

    def close(self, *, wait: bool = False) -> None:
        """Cancels evaluations not started; ``wait``: also waits for the running one."""
        self._executor.shutdown(wait=wait, cancel_futures=True)


class EvaluationMixin:
    """Controller methods: held-out evaluations, beside training or stopping it (see loop.Controller)."""

    def _pass_counts(
        self,
        problems: Sequence[tuple[str, Any]],
        k: int,
        *,
        stream: str,
        answers: list[dict[str, Any]] | None = None,
        episodes: dict[str, int] | None = None,
        version: int | None = None,
    ) -> dict[str, int]:
        """Samples accepted of ``k`` per (key, problem), generated with the current version;
        each sample's text and verdict are appended to ``answers`` if given. With ``episodes``
        (a dict to fill) and an environment, each sample is also played out as an episode and
        ``episodes`` gets the episodes accepted at their last turn per key. ``version`` given:
        generated with it, uncounted in the pool's load balance (beside training)."""
        counted = version is None
        version = self.version if version is None else version
        self.publishes.wait(version)  # a version still being pushed: no worker can load it yet
        requests = [
            self.prompter.request(f"{stream}/{key}", p, num_samples=k, stream=stream)
            for key, p in problems
        ]
        by_key = {f"{stream}/{key}": (key, p) for key, p in problems}
        if episodes is not None and self.episodes is not None:
            played = self.episodes.play(
                version, requests, {k: p for k, (_, p) in by_key.items()}, counted=counted
            )
            rollouts = played.first_turns
        else:
            played = None
            rollouts = self.pool.submit(
                version, requests, counted=counted, ahead=not counted
            ).result()
        items = [(by_key[ro.prompt_id][1], ro) for ro in rollouts]
        # First turns the episodes' environment graded already are not run again.
        memo = getattr(self.episodes.tools, "memo", None) if played is not None else None
        verdicts = groups_lib.verify(self.c.verifier, self.specs, self.prompter, items, memo)
        finals = verdicts if played is None else played.verdicts
        played = rollouts if played is None else played.episodes
        correct = {key: 0 for key, _ in problems}
        for ro, v, ep, final in zip(rollouts, verdicts, played, finals, strict=True):
            key, problem = by_key[ro.prompt_id]
            correct[key] += int(v.accepted)
            if episodes is not None:
                episodes[key] = episodes.get(key, 0) + int(final.accepted)
            if answers is not None:
                answers.append(
                    {
                        "problem": key,
                        "question": getattr(problem, "question", ""),
                        "answer": self.prompter.completion(ro),
                        "verdict": v.kind.value,
                        "detail": v.detail,
                        "finish_reason": ro.finish_reason.value,
                    }
                    | (
                        {
                            "episode": self.prompter.completion(ep),
                            "episode_verdict": final.kind.value,
                            "episode_detail": final.detail,
                        }
                        if ep is not ro
                        else {}
                    )
                )
        return correct

    def evaluate_version(self, version: int) -> dict[str, float]:
        """Held-out pass@1 and pass@k (k = data.eval_samples) of ``version``, its problems sent
        ``data.eval_share`` of the workers' slots at a time, uncounted in the pool's balance
        (it runs beside training: controller/evaluation.py); {} without held-out problems."""
        problems = self.prompter.datasets.held_out
        if not problems:
            return {}
        inf = self.config.inference
        # A worker in deterministic mode runs one job at a time: a chunk short of its slots
        # would leave the rest idle, so there every chunk fills them (eval_share is for a
        # shared engine).
        share = self.config.data.eval_share if self.cc.mode == "throughput" else 1.0
        # Its own lease, released when it ends: the controller's lease set is replaced every
        # step, and a version held for an evaluation must not wait for the next one.
        self.lease([version], consumer=EVAL_LEASE)
        try:
            return self.evaluate_problems(
                [(p.id, p) for p in problems],
                self.run_dir / EVAL_DIR / f"version_{version:06d}.jsonl",
                stream="eval",
                chunk=problems_at_once(
                    share,
                    len(self.pool.workers),
                    inf.max_concurrent_seqs,
                    self.config.data.eval_samples,
                ),
                version=version,
                quiet=True,
            )
        finally:
            self.lease([], consumer=EVAL_LEASE)

    def evaluate_problems(
        self,
        problems: Sequence[tuple[str, Problem]],
        answers_file: Path,
        *,
        stream: str,
        chunk: int = 0,
        version: int | None = None,
        quiet: bool = False,
    ) -> dict[str, float]:
        """pass@1 and pass@k (k = data.eval_samples) of ``(key, problem)`` pairs with
        ``version`` (default the current one); every sample's text and verdict go to
        ``answers_file`` (JSON lines), so a run's answers can be read and compared across
        versions. Prompts longer than the workers take are left out (``eval/problems`` counts
        the rest). ``chunk`` > 0 sends that many problems at a time and, unless ``quiet``,
        reports progress after each. With ``version`` given the requests do not count in the
        pool's load balance (an evaluation beside training)."""
        k = self.config.data.eval_samples
        t0 = time.perf_counter()
        fitting = [(key, p) for key, p in problems if self.prompter.fits(p)]
        if not fitting:
            raise ValueError(
                f"no problem to evaluate: {len(problems)} given, none within "
                f"inference.max_prompt_len = {self.config.inference.max_prompt_len} tokens"
            )
        answers: list[dict[str, Any]] = []
        counts: list[int] = []
        episodes: dict[str, int] = {}
        size = chunk if chunk > 0 else len(fitting)
        for start in range(0, len(fitting), size):
            part = fitting[start : start + size]
            counts += self._pass_counts(
                part, k, stream=stream, answers=answers, episodes=episodes, version=version
            ).values()
            if chunk > 0 and not quiet:
                done = start + len(part)
                self._event(
                    f"  {done}/{len(fitting)} problems, pass@1 so far "
                    f"{mean_pass_at_k(counts, k, 1):.3f} ({time.perf_counter() - t0:.0f} s)"
                )
        storage.write_atomic(answers_file, "".join(json.dumps(a) + "\n" for a in answers))
        played = list(episodes.values()) if self.episodes is not None else []
        return {
            "eval/pass@1": mean_pass_at_k(counts, k, 1),
            f"eval/pass@{k}": mean_pass_at_k(counts, k, k),
            "eval/problems": float(len(counts)),
            "time/eval": time.perf_counter() - t0,
        } | (
            {
                "eval/episode_pass@1": mean_pass_at_k(played, k, 1),
                f"eval/episode_pass@{k}": mean_pass_at_k(played, k, k),
            }
            if played
            else {}
        )

    def _eval_due(self) -> bool:
        every = self.config.data.eval_every
        if self.counters.last_eval_version >= self.version:
            return False
        return self.version in (0, self.cc.num_steps) or (every > 0 and self.version % every == 0)

    def start_eval_if_due(self) -> None:
        """Starts the evaluation of the current version if one is due; it runs beside
        training (``log_evals`` takes it when done)."""
        if self._eval_due():
            self.counters.last_eval_version = self.version
            self.background_evals.start(self.version)
            if self.config.inference.continue_on_reload:
                # A newer job reloads a worker under running ones (partial rollouts): an
                # evaluation beside training would sample from weights other than its own.
                self.background_evals.wait()

    def log_evals(self, metrics: MetricsWriter, progress: Progress, *, wait: bool = False) -> None:
        """Logs the evaluations that finished, each against its version; ``wait``: every one
        started, after it finished."""
        for version, m in self.background_evals.take_done(wait=wait):
            if not m:
                continue
            self.evals[version] = m
            metrics.write(version, m)
            answers = self.run_dir / EVAL_DIR / f"version_{version:06d}.jsonl"
            if answers.exists():  # every sample's text and verdict, to the sinks with tables
                rows = [json.loads(line) for line in answers.read_text().splitlines() if line]
                metrics.table(version, "eval/answers", rows)
            k = self.config.data.eval_samples
            more = f", pass@{k} {m[f'eval/pass@{k}']:.3f}" if k > 1 else ""
            if "eval/episode_pass@1" in m:
                more += f", after the episode {m['eval/episode_pass@1']:.3f}"
            progress.message(
                f"eval at version {version}: held-out pass@1 {m['eval/pass@1']:.3f}{more} "
                f"on {int(m['eval/problems'])} problems"
            )

    def resume_evals(self) -> None:
        """Evaluations a killed run had in flight: a result its metrics hold is taken as it
        was logged; the others are started again by the first ``ensure_versions`` (which
        republishes their versions with the run's own, in one ascending pass); one whose
        version is neither on the parameter server nor in a trainer checkpoint is named lost."""
        if not self._evals_in_flight:
            return
        logged = {
            r["step"]: r["scalars"]
            for r in read_metrics(self.run_dir)
            if any(k.startswith("eval/pass@") for k in r["scalars"])
        }
        hot, _ = self.c.param_server.list_versions()
        available = {v.version for v in hot} | set(self.c.trainer.status().checkpoint_steps)
        again = []
        for version in self._evals_in_flight:
            if version in logged:
                self.evals[version] = logged[version]
            elif version in available:
                again.append(version)
            else:
                self._warn(
                    f"the evaluation of version {version} is lost (no trainer checkpoint or "
                    "parameter-server copy of it is left)"
                )
        self._evals_in_flight = again

    def _restart_evals(self) -> None:
        """Starts the evaluations a resumed run had in flight (``resume_evals`` kept those its
        metrics did not hold), once ``ensure_versions`` republished their versions."""
        for version in self._evals_in_flight:
            self.background_evals.start(version)
        self._evals_in_flight = []
