"""One entry point for every component (the container image's): picks one by name.

    python -m rlax_tpu COMPONENT [--config=FILE[:PRESET]] [--config.a.b=value ...]

COMPONENT is one of: controller, launch, trainer, inference, param_server, verifiers, aot,
plan, probe (the health probe). `python -m rlax_tpu COMPONENT --help` explains each.
"""

from __future__ import annotations

import runpy
import sys

COMPONENTS = {
    "controller": "rlax_tpu.controller",
    "launch": "rlax_tpu.launch",
    "trainer": "rlax_tpu.trainer",
    "inference": "rlax_tpu.inference",
    "param_server": "rlax_tpu.param_server",
    "verifiers": "rlax_tpu.verifiers",
    "aot": "rlax_tpu.aot",
    "plan": "rlax_tpu.plan",
    "probe": "rlax_tpu.rpc.probe",
}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0 if len(sys.argv) >= 2 else 2)
    name = sys.argv[1]
    if name not in COMPONENTS:
        print(
            f"rlax_tpu: unknown component {name!r}; one of {', '.join(COMPONENTS)}", file=sys.stderr
        )
        sys.exit(2)
    sys.argv = [f"python -m {COMPONENTS[name]}", *sys.argv[2:]]
    runpy.run_module(COMPONENTS[name], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
