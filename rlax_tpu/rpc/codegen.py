"""Generates the Python stubs of ``rlax_tpu/rpc/*.proto`` (committed next to the protos).

    python -m rlax_tpu.rpc.codegen          # regenerate
    python -m rlax_tpu.rpc.codegen --check  # exit 1 if a committed stub is out of date

Protos are compiled from the repository root, so generated imports read
``from rlax_tpu.rpc import x_pb2``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

RPC_DIR = Path(__file__).resolve().parent
ROOT = RPC_DIR.parent.parent
SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def generate(out_root: Path) -> list[Path]:
    """Compiles every proto into ``out_root``/rlax_tpu/rpc; returns the generated files."""
    protos = sorted(RPC_DIR.glob("*.proto"))
    if not protos:
        return []
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p.relative_to(ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {', '.join(p.name for p in protos)}")
    out_dir = out_root / "rlax_tpu" / "rpc"
    return sorted(p for p in out_dir.iterdir() if p.name.endswith(SUFFIXES))


def stale_stubs() -> list[str]:
    """Names of stubs that differ from (or are missing next to) what the protos generate."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        bad = [
            f.name
            for f in fresh
            if not (RPC_DIR / f.name).is_file() or (RPC_DIR / f.name).read_bytes() != f.read_bytes()
        ]
        expected = {f.name for f in fresh}
    bad += [
        p.name for p in RPC_DIR.iterdir() if p.name.endswith(SUFFIXES) and p.name not in expected
    ]
    return sorted(bad)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that stubs are current")
    args = parser.parse_args(argv)
    if args.check:
        bad = stale_stubs()
        for name in bad:
            print(f"out of date: rlax_tpu/rpc/{name}", file=sys.stderr)
        return 1 if bad else 0
    with tempfile.TemporaryDirectory() as tmp:
        for f in generate(Path(tmp)):
            (RPC_DIR / f.name).write_bytes(f.read_bytes())
            print(f"wrote rlax_tpu/rpc/{f.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
