"""Per-chip memory, FLOPs and roofline time of every TPU preset's programs, compiled through libtpu
for the preset's topology on this (CPU) machine by ``python -m rlax_tpu.aot``.

    python benchmarks/aot_presets.py                 # every case below, then the tables
    python benchmarks/aot_presets.py --only smollm2  # cases whose name contains "smollm2"
    python benchmarks/aot_presets.py --tables        # tables from the saved JSON only

Each case's report is saved as benchmarks/aot/<case>.json; the markdown tables go to stdout (they
are pasted into benchmarks/RESULTS.md and the README's presets table). The roofline time is the
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
    "v5p-inference-v5p_2x2x1": ["--config=configs/codeforces.py:v5p", "--topology=v5p:2x2x1",
                                "--component=inference"],  # fmt: skip
    # The 64 unrolled layers' gradient step for 256 chips exhausts this 24 GiB host while XLA
    # compiles it (killed at 22 GB resident after 14 min): the trainer is compiled at 2 and 4
    # layers and extrapolated (see extrapolated_table).
    **{f"v5p-trainer-v5p_8x8x4-L{n}": ["--config=configs/codeforces.py:v5p", "--topology=v5p:8x8x4",
                                       "--component=trainer", f"--config.model.num_layers={n}"]
       for n in (2, 4)},  # fmt: skip
}
EXTRAPOLATE = {"v5p-trainer-v5p_8x8x4": (("v5p-trainer-v5p_8x8x4-L2", 2),
                                         ("v5p-trainer-v5p_8x8x4-L4", 4), 64)}  # fmt: skip
LINEAR = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "resident_bytes",
          "flops", "bytes_accessed")  # fmt: skip


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
        "| program | topology | status | args GiB | temp GiB | resident GiB | peak GiB | % HBM | TFLOP | GB accessed | roofline ms |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for p in report["programs"]:
        if p["argument_bytes"]:
            rows.append(
                f"| {p['name']} | {p['topology']} | {p['status']} | {_gib(p['argument_bytes'])} | "
                f"{_gib(p['temp_bytes'])} | {_gib(p['resident_bytes'])} | {_gib(p['peak_bytes'])} | "
                f"{100 * p['hbm_fraction']:.1f} | {p['flops'] / 1e12:.3f} | "
                f"{p['bytes_accessed'] / 1e9:.2f} | {1e3 * p['roofline_s']:.2f} |"
            )
        else:
            rows.append(f"| {p['name']} | {p['topology']} | {p['status']} | {p['error']} |||||||")
    return "\n".join(rows)


def extrapolated_table(name: str) -> str:
    """Every quantity of a program is affine in the layer count when layers are unrolled and
    remat'd (parameters, optimizer state, saved layer inputs, per-layer FLOPs and traffic; the
    embedding, LM head and one layer's working set are the constant), so two compiled depths
    give it at any depth. Exact for parameter-sized quantities; the compiler's scheduling of
    temporaries at full depth is the approximation."""
    (small, a), (large, b), target = EXTRAPOLATE[name]
    reports = [json.loads((OUT / f"{n}.json").read_text()) for n in (small, large)]
    spec = next(iter(reports[0]["devices"].values()))
    bw, peak_flops, usable = spec["hbm_bandwidth"], spec["bf16_flops"], spec["usable_hbm_bytes"]
    rows = [
        f"Extrapolated to {target} layers from `{reports[0]['command']}` and the same at {b} layers.",
        "",
        "| program | status at 64 layers | args GiB | temp GiB | resident GiB | peak GiB | % HBM | TFLOP | GB accessed | roofline ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    progs = [{p["name"]: p for p in r["programs"]} for r in reports]
    for pname, p0 in progs[0].items():
        p1 = progs[1][pname]
        if not (p0["argument_bytes"] and p1["argument_bytes"]):
            rows.append(f"| {pname} | {p1['status']}: {p1['error']} |||||||||")
            continue
        at = {k: p0[k] + (p1[k] - p0[k]) * (target - a) / (b - a) for k in LINEAR}
        program = at["argument_bytes"] + at["output_bytes"] - at["alias_bytes"] + at["temp_bytes"]
        peak = program + at["resident_bytes"]
        roof = max(at["flops"] / peak_flops, at["bytes_accessed"] / bw)
        status = "fits" if peak <= usable else "does not fit"
        rows.append(
            f"| {pname} | {status} | {_gib(at['argument_bytes'])} | {_gib(at['temp_bytes'])} | "
            f"{_gib(at['resident_bytes'])} | {_gib(peak)} | {100 * peak / usable:.1f} | "
            f"{at['flops'] / 1e12:.2f} | {at['bytes_accessed'] / 1e9:.1f} | {1e3 * roof:.1f} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    parser.add_argument("--tables", action="store_true", help="print tables from saved JSON only")
    args = parser.parse_args()
    names = [n for n in CASES if args.only in n]
    if not args.tables:
        for name in names:
            run_case(name, CASES[name])
    for name in names:
        if (OUT / f"{name}.json").exists():
            print(f"\n### {name}\n\n{table(name)}")
    for name, ((small, _), (large, _), _) in EXTRAPOLATE.items():
        if args.only in name and (OUT / f"{small}.json").exists() and (OUT / f"{large}.json").exists():
            print(f"\n### {name} (extrapolated)\n\n{extrapolated_table(name)}")


if __name__ == "__main__":
    main()
