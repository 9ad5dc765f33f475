from __future__ import annotations

from pathlib import Path

from rlax_tpu.observability.metrics import MetricsWriter
from rlax_tpu.observability.report import RunInfo, write_report
from rlax_tpu.observability.samples import read_samples, sampled_steps, write_samples

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_report_has_every_plot_and_says_what_was_run(tmp_path: Path):
    with MetricsWriter(tmp_path) as w:
        for step in range(6):
            scalars = {
                "reward/mean": step / 10,
                "throughput/tokens_per_s": 100 + step,
                "verdict/accepted": step,
                "verdict/wrong_answer": 6 - step,
                "time/generate": 1.0,
                "time/train": 0.5,
            }
            if step in (0, 5):
                scalars["eval/pass@1"] = 0.1 if step == 0 else 0.4
            w.write(step, scalars, {"staleness": [0, 1]}, wall_time=1000.0 + 60 * step)
    info = RunInfo(
        command="make run",
        config={"preset": "local"},
        model="tiny llama",
        commit="abc123",
        notes=["a supervised warm-up ran before RL"],
    )
    report = write_report(tmp_path, info, summary={"steps": 6})
    text = report.read_text()
    for png in ("learning", "staleness", "tokens_per_s", "verdicts", "step_time"):
        path = tmp_path / "plots" / f"{png}.png"
        assert path.read_bytes()[:8] == PNG_MAGIC
        assert f"(plots/{png}.png)" in text
    assert "| eval/pass@1 | 0.100 | 0.400 | +0.300 |" in text
    assert "- commit: `abc123`" in text and "- note: a supervised warm-up ran before RL" in text
    assert '"preset": "local"' in text


def test_report_without_metrics_says_what_is_missing(tmp_path: Path):
    report = write_report(tmp_path, RunInfo(command="x", config={}, model="m", commit="c"))
    assert report.read_text().count("_not logged in this run_") == 5


def test_report_links_a_few_steps_training_samples(tmp_path: Path):
    for step in range(1, 11):
        rows = [
            {
                "step": step,
                "completion": f"def f():\n    return {step}  `x`" + " pad" * 50,
                "reward": step / 10,
                "advantage": None if step == 1 else 0.5,
                "staleness": 1,
                "finish_reason": "eos",
                "tokens": 7,
            }
        ]
        write_samples(tmp_path, step, rows)
    assert sampled_steps(tmp_path) == list(range(1, 11))
    assert read_samples(tmp_path, 4)[0]["reward"] == 0.4
    text = write_report(
        tmp_path, RunInfo(command="x", config={}, model="m", commit="c")
    ).read_text()
    assert "10 updates have samples in `samples/`" in text
    links = [line for line in text.splitlines() if line.startswith("- [step ")]
    # First and last, evenly apart.
    assert [line.split("]")[0] for line in links] == [
        "- [step 1",
        "- [step 4",
        "- [step 7",
        "- [step 10",
    ]
    assert (
        "(samples/step_000010.jsonl): 1 rollouts; the first: reward 1.00, advantage +0.500" in text
    )
    assert "advantage n/a" in links[0]
    assert "`def f(): return 1 'x' pad pad" in links[0]  # one line, no backquote inside
