"""Per-chip memory, FLOPs and roofline time of every TPU preset's programs, compiled through libtpu
for the preset's topology on this (CPU) machine by ``python -m rlax_tpu.aot``.

    python benchmarks/aot_presets.py                 # every case below, then the tables
    python benchmarks/aot_presets.py --only smollm2  # cases whose name contains "smollm2"
    python benchmarks/aot_presets.py --only v5p_moe,v5p_small  # either
    python benchmarks/aot_presets.py --tables        # tables from the saved JSON only

Each case's report is saved as benchmarks/aot/<case>.json; the markdown tables go to stdout (they
are pasted into benchmarks/RESULTS.md and the presets table of docs/aot.md). The roofline time is the
compiled program's FLOPs at the chip's bf16 peak or its bytes accessed at the HBM bandwidth,
whichever is slower: the physical limit for that program on that chip, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "aot"

# name -> arguments of python -m rlax_tpu.aot
CASES: dict[str, list[str]] = {
    "local-v5e_2x2": ["--config=configs/codeforces.py:local", "--topology=v5e:2x2"],
    "smollm2-v5e_2x2": ["--config=configs/smollm2_math.py:tpu", "--topology=v5e:2x2"],
    "smollm2-v5p_2x2x1": ["--config=configs/smollm2_math.py:tpu", "--topology=v5p:2x2x1"],
    # RLAX's layout: the trainer on a v5p-512 slice, each inference worker on its own slice.
    "v5p-inference-v5p_2x2x1": [
        "--config=configs/codeforces.py:v5p",
        "--topology=v5p:2x2x1",
        "--component=inference",
    ],
    # The trainer's 64 layers are scanned (trainer.scan_layers): one layer body whatever the depth,
    # so the full step compiles on this 24 GiB host (unrolled, XLA was killed at 22 GB after 14
    # min); FLOPs and bytes of scanned programs are counted by depth (aot/report.cost_by_depth).
    "v5p-trainer-v5p_4x8x8": [
        "--config=configs/codeforces.py:v5p",
        "--topology=v5p:4x8x8",
        "--component=trainer",
    ],
    # The same trainer over two 128-chip slices joined by DCN (multislice: data across slices).
    # Tensor 4: a mesh axis takes whole torus axes, and 8 is no product of 4x4x4's (4 and 16
    # are; 4 divides the 40 heads and 8 KV heads, and is the workers' degree).
    "v5p-trainer-2xv5p_4x4x4": [
        "--config=configs/codeforces.py:v5p",
        "--topology=v5p:4x4x4",
        "--component=trainer",
        "--config.mesh.slices=2",
        "--config.mesh.tensor=4",
    ],
    # One TPU VM of 8 chips split in two halves (trainer, one worker): each half is a v5e:2x2.
    "tpu_vm-v5e_2x2": ["--config=configs/codeforces.py:tpu_vm", "--topology=v5e:2x2"],
    "v5p_small-trainer-v5p_2x2x2": [
        "--config=configs/codeforces.py:v5p_small",
        "--topology=v5p:2x2x2",
        "--component=trainer",
    ],
    "v5p_small-inference-v5p_2x2x1": [
        "--config=configs/codeforces.py:v5p_small",
        "--topology=v5p:2x2x1",
        "--component=inference",
    ],
    # The same trainers with LoRA adapters (rank 16 on every projection; issue [lora]): the
    # base frozen in bf16 with no optimizer state, a version the adapters alone.
    "v5p_small-lora-trainer-v5p_2x2x2": [
        "--config=configs/codeforces.py:v5p_small",
        "--topology=v5p:2x2x2",
        "--component=trainer",
        "--config.model.lora_rank=16",
    ],
    "v5p-lora-trainer-v5p_4x8x8": [
        "--config=configs/codeforces.py:v5p",
        "--topology=v5p:4x8x8",
        "--component=trainer",
        "--config.model.lora_rank=16",
    ],
    # A mixture of experts (issue [moe]): Qwen3-30B-A3B, its 128 experts split 4 ways over the
    # trainer's expert axis (fsdp 16 x expert 4), the workers' split over tensor.
    "v5p_moe-trainer-v5p_4x4x4": [
        "--config=configs/codeforces.py:v5p_moe",
        "--topology=v5p:4x4x4",
        "--component=trainer",
    ],
    "v5p_moe-inference-v5p_2x2x1": [
        "--config=configs/codeforces.py:v5p_moe",
        "--topology=v5p:2x2x1",
        "--component=inference",
    ],
}


def run_case(name: str, args: list[str]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    cmd = [sys.executable, "-m", "rlax_tpu.aot", *args, f"--json={path.relative_to(REPO)}"]
    print(f"== {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    verdicts = [ln for ln in proc.stderr.splitlines() if ln.startswith("rlax_tpu.aot")]
    print(f"   exit {proc.returncode} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    for line in verdicts:
        print(f"   {line}", file=sys.stderr)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def table(name: str) -> str:
    report = json.loads((OUT / f"{name}.json").read_text())
    rows = [
        f"`{report['command']}`",
        "",
        "| program | topology | status | args GiB | temp GiB | held GiB | peak GiB | % HBM | limit GiB | TFLOP | GB accessed | roofline ms |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    held = []
    for p in report["programs"]:
        if p["argument_bytes"]:
            rows.append(
                f"| {p['name']} | {p['topology']} | {p['status']} | {_gib(p['argument_bytes'])} | "
                f"{_gib(p['temp_bytes'])} | {_gib(p['resident_bytes'])} | {_gib(p['peak_bytes'])} | "
                f"{100 * p['hbm_fraction']:.1f} | {_gib(p.get('limit_bytes', p['hbm_bytes']))} | "
                f"{p['flops'] / 1e12:.3f} | {p['bytes_accessed'] / 1e9:.2f} | "
                f"{1e3 * p['roofline_s']:.2f} |"
            )
        else:
            rows.append(f"| {p['name']} | {p['topology']} | {p['status']} | {p['error']} ||||||||")
        if p.get("held"):
            parts = ", ".join(f"{k} {_gib(v)}" for k, v in p["held"].items())
            held.append(f"- {p['name']}: {parts}")
    if held:
        rows += ["", "Held beside each program (GiB per device):", *held]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        default="",
        help="run the cases whose name contains this (or, comma-separated, any)",
    )
    parser.add_argument("--tables", action="store_true", help="print tables from saved JSON only")
    args = parser.parse_args()
    names = [n for n in CASES if any(part in n for part in args.only.split(","))]
    if not args.tables:
        for name in names:
            run_case(name, CASES[name])
    for name in names:
        if (OUT / f"{name}.json").exists():
            print(f"\n### {name}\n\n{table(name)}")


if __name__ == "__main__":
    main()
