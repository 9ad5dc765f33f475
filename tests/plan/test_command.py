"""``python -m rlax_tpu.plan`` on reports of ``python -m rlax_tpu.aot --json``'s format."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlax_tpu.plan.command import PlanError, plan
from tests.config.test_validation import build
from tests.plan.test_costs import ROOFLINE

REPO = Path(__file__).resolve().parents[2]


def _reports(tmp_path: Path, *, inference_topology: str = "v5e:2x2", status: str = "fits") -> str:
    programs = [
        {
            "name": name,
            "component": name.split(".")[0],
            "topology": "v5e:2x2" if name.startswith("trainer") else inference_topology,
            "status": status if name == "trainer.apply" else "fits",
            "roofline_s": seconds,
        }
        for name, seconds in ROOFLINE.seconds.items()
    ]
    path = tmp_path / f"report-{inference_topology}-{status}.json"
    path.write_text(json.dumps({"command": "test", "programs": programs}))
    return str(path)


def _plan(tmp_path: Path, **kw):  # noqa: ANN003, ANN202
    args = {
        "trainer_topology": "v5e:2x2",
        "inference_topology": "v5e:2x2",
        "aot": [_reports(tmp_path)],
        "lengths": ["100", "40"],
        "efficiency": ["train=0.5", "decode=0.25", "prefill=0.8"],
        "server_gbps": 8.0,  # 1 GB/s
        "pull_gbps": 16.0,
        "check_s": 0.5,
        "steps": 20,
    } | kw
    return plan(build({}), **args)


def test_a_sweep_gives_a_row_per_worker_count_and_the_json_the_costs(tmp_path):
    table, out = _plan(tmp_path, workers=["1", "2", "4"])
    rows = [ln.split() for ln in table.splitlines() if ln.split() and ln.split()[0].isdigit()]
    assert [r[0] for r in rows] == ["1", "2", "4"]
    first = out["predictions"][0]
    # The hand-worked costs of tests/plan/test_costs.py, through the command's flags.
    assert first["costs"]["train_s"] == pytest.approx(6.226315789473684 + 3.41248e-3, rel=1e-9)
    assert first["costs"]["group_s"] == pytest.approx(2.225, rel=1e-9)
    assert out["assumptions"]["completion_tokens"] == 40 and out["assumptions"]["mode"] == (
        "deterministic"
    )
    # Lock-step one-step-off-policy: every group consumed one version old.
    assert set(first["staleness"]) == {"1"}
    # With loads this fast, more workers never make an update slower (a slow parameter server
    # can: workers loading at once share it). Each row says where the time goes.
    periods = [p["seconds_per_update"] for p in out["predictions"]]
    assert periods == sorted(periods, reverse=True)
    assert all(p["bottleneck"] for p in out["predictions"])


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"aot": None, "inference_topology": "v5p:2x2x1"}, "compiled for v5e:2x2, not v5p:2x2x1"),
        ({"aot": "too_big"}, "trainer.apply does not fit on v5e:2x2"),
        ({"efficiency": ["train=2"]}, "must be in \\(0, 1\\]"),
        ({"efficiency": ["speed=1"]}, "train=E, decode=E or prefill=E expected"),
        ({"lengths": ["100"]}, "PROMPT,COMPLETION expected"),
        ({"workers": ["0"]}, "counts must be >= 1"),
        ({"trainer_topology": ""}, "names no TPU topology"),
        ({"delta_ratio": 0.0}, "--delta_ratio must be in \\(0, 1\\]"),
    ],
)
def test_bad_flags_and_reports_are_refused_with_the_reason(tmp_path, kw, message):
    if "aot" in kw:
        status = "does not fit" if kw["aot"] == "too_big" else "fits"
        kw = kw | {"aot": [_reports(tmp_path, status=status)]}
    with pytest.raises(PlanError, match=message):
        _plan(tmp_path, **kw)


def test_the_command_prints_the_table_and_writes_the_json(tmp_path):
    out = tmp_path / "plan.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlax_tpu.plan",
            "--config=configs/codeforces.py:local",
            "--trainer_topology=v5e:2x2",
            "--inference_topology=v5e:2x2",
            f"--aot={_reports(tmp_path)}",
            "--workers=1,2",
            "--steps=12",
            f"--json={out}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "s/update" in proc.stdout and "bottleneck" in proc.stdout
    written = json.loads(out.read_text())
    assert [p["workers"] for p in written["predictions"]] == [1, 2]
    assert written["command"].startswith("python -m rlax_tpu.plan --config=")
    bad = subprocess.run(
        [sys.executable, "-m", "rlax_tpu.plan", "--config=configs/codeforces.py:local"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "names no TPU topology" in bad.stderr
