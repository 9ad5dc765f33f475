"""Shared command-line plumbing for the entry points (``python -m rlax_tpu.<component>``).

Every entry point takes ``--config=<file>[:<preset>]`` (ml_collections config files) plus
``--config.<section>.<field>=<value>`` overrides, validates the result into a :class:`RunConfig`
and hands it to the component's main. Bad input ends with one clear line and exit code 2, not a
traceback (set ``RLAX_DEBUG=1`` to see the traceback).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from rlax_tpu.config import ConfigError, RunConfig, base_config_dict, from_dict, to_dict
from rlax_tpu.config.run import check_runnable

EXIT_USAGE = 2  # bad flags or config
# A service stopped by SIGTERM or SIGINT (128 + SIGTERM). A service never finishes on its own,
# so a stop is never success: on GKE a drained node's pod is then Failed and its Job restarts
# it, where exit 0 would mark it Succeeded and leave the run without it.
EXIT_STOPPED = 143

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "codeforces.py"

_OVERRIDE = re.compile(r"^--config\.([A-Za-z0-9_.]+)(=|$)")


class UsageError(Exception):
    """Bad command-line input; the message is shown to the user as is."""


def _debug() -> bool:
    return os.environ.get("RLAX_DEBUG", "") not in ("", "0")


def unknown_override(argv: Sequence[str]) -> str | None:
    """Describes the first ``--config.a.b=`` override whose path is not a config field, if any."""
    base = base_config_dict()
    for arg in argv:
        m = _OVERRIDE.match(arg)
        if not m:
            continue
        node, walked = base, []
        for part in m.group(1).split("."):
            keys = list(node.keys()) if hasattr(node, "keys") else []
            if part not in keys:
                where = ".".join(walked) or "the top level"
                close = difflib.get_close_matches(part, keys, n=1)
                hint = f"; did you mean {'.'.join([*walked, close[0]])!r}?" if close else ""
                return f"{arg}: unknown config field {part!r} in {where}{hint}"
            node, walked = node[part], [*walked, part]
    return None


def config_args(argv: Sequence[str]) -> list[str]:
    """The ``--config=FILE[:PRESET]`` and ``--config.a.b=v`` flags of ``argv``, the default config
    file first when none is named: what another process needs to build the same config."""
    flags = [a for a in argv if a.startswith("--config=") or a.startswith("--config.")]
    if not any(a.startswith("--config=") for a in flags):
        flags.insert(0, f"--config={DEFAULT_CONFIG}")
    return flags


def tuple_value(items: Sequence[str]) -> str:
    """A tuple of strings as a ``--config.a.b=`` override value: ``('x','y',)``."""
    return "(" + "".join(f"'{x}'," for x in items) + ")"


def _missing_config_file(argv: Sequence[str]) -> str | None:
    for arg in argv:
        if arg.startswith("--config="):
            path = arg.removeprefix("--config=").split(":", 1)[0]
            if not Path(path).is_file():
                return f"{arg}: no such config file {path!r}"
    return None


def _last_line_if_traceback(message: str) -> str:
    """config_flags embeds the config file's traceback; the last line says what went wrong."""
    if "Traceback" not in message:
        return message
    first = message.splitlines()[0].rstrip(":")
    last = [ln for ln in message.splitlines() if ln.strip()][-1]
    return f"{first}: {last}"


def _config_flag_default() -> str | None:
    return str(DEFAULT_CONFIG) if DEFAULT_CONFIG.exists() else None


def load_config(argv: Sequence[str]) -> tuple[RunConfig, list[str]]:
    """Parses ``argv`` into a validated RunConfig and the remaining positional arguments.

    ``argv[0]`` is the program name. Raises UsageError.
    """
    problem = unknown_override(argv) or _missing_config_file(argv)
    if problem:
        raise UsageError(problem)
    try:
        rest = flags.FLAGS(list(argv))
    except flags.Error as e:
        if _debug():
            raise
        raise UsageError(_last_line_if_traceback(str(e))) from e
    except Exception as e:  # config file errors: missing file, bad preset, syntax error
        if _debug():
            raise
        raise UsageError(f"--config: {type(e).__name__}: {e}") from e
    cfg_dict = flags.FLAGS["config"].value
    if cfg_dict is None:
        raise UsageError("--config is required (e.g. --config=configs/codeforces.py:local)")
    try:
        config = from_dict(RunConfig, cfg_dict)
        check_runnable(config)
    except ConfigError as e:
        raise UsageError(f"config error: {e}") from e
    return config, rest


# The components that compile (the controller does in its local transport).
CACHED_COMPONENTS = ("controller", "trainer", "inference")
COMPILATION_CACHE_DIR = "jax_cache"


def compilation_cache_dir(config: RunConfig) -> str:
    """Where JAX's persistent compilation cache is: ``<run_dir>/jax_cache`` (gs:// when the run
    directory is, as on GKE), or ``$JAX_COMPILATION_CACHE_DIR`` when the environment names one (a
    cache shared by many runs of one model); "" when ``controller.compilation_cache`` is off."""
    if not config.controller.compilation_cache:
        return ""
    return os.environ.get("JAX_COMPILATION_CACHE_DIR") or (
        f"{config.controller.run_dir.rstrip('/')}/{COMPILATION_CACHE_DIR}"
    )


def use_compilation_cache(config: RunConfig) -> str:
    """Points JAX's persistent compilation cache at :func:`compilation_cache_dir` (every
    program: a restarted trainer compiles a dozen small ones before its first step). Returns it.

    Every process of a multi-host job uses it too. JAX's docs/persistent_compilation_cache.md:
    with several processes "all processes will compile, but only the process with rank 0 in the
    global communication group will write to the persistent cache. In subsequent runs, all
    processes will attempt to read from the persistent cache, so it is important for the
    persistent cache to be in a shared file system ... or remote storage" (jax/_src/compiler.py
    ``_cache_write`` returns when ``distributed.global_state.process_id != 0``); and a gs://
    location works where etils is installed ("if the compilation cache is not on a local
    filesystem, etils needs to be installed": etils[epath] and gcsfs are dependencies)."""
    where = compilation_cache_dir(config)
    if not where:
        return ""
    import jax

    jax.config.update("jax_compilation_cache_dir", where)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return where


def stop_event() -> threading.Event:
    """An event set by SIGTERM or SIGINT. Wait on it with ``wait_for(event)``."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def wait_for(stop: threading.Event) -> None:
    """Blocks until ``stop`` is set.

    Polls, because a bare ``wait()`` can miss the signal for good: the kernel may deliver it to
    another thread (gRPC's, a pool's), and the main thread, asleep on a lock, never wakes to run
    the Python handler. CI once saw a verifier ignore SIGTERM for 60 s that way.
    """
    while not stop.wait(0.5):
        pass


def main(component: str, run: Callable[[RunConfig, list[str]], int]) -> None:
    """Entry point of ``python -m rlax_tpu.<component>``: parse flags, validate, run.

    ``run(config, positional_args)`` returns the process exit code.
    """
    if "config" not in flags.FLAGS:
        config_flags.DEFINE_config_file(
            "config",
            default=_config_flag_default(),
            help_string="Config file and optional preset: configs/codeforces.py[:local|v5p]. "
            "Override any field with --config.<section>.<field>=<value>.",
            lock_config=True,
        )
        flags.DEFINE_boolean(
            "print_config", False, "Print the validated config as JSON and exit without running."
        )
    holder: dict[str, RunConfig] = {}

    def parse(argv: list[str]) -> list[str]:
        if any(a in ("-h", "--help", "--helpshort", "-?") for a in argv[1:]):
            print(usage(component))
            sys.exit(0)
        try:
            holder["cfg"], rest = load_config(argv)
        except UsageError as e:
            print(f"rlax_tpu.{component}: error: {e}", file=sys.stderr)
            sys.exit(EXIT_USAGE)
        return rest

    def _main(args: list[str]) -> int:
        if flags.FLAGS.print_config:
            print(json.dumps(to_dict(holder["cfg"]), indent=2))
            return 0
        cfg = holder["cfg"]
        # Every process, a jax.distributed job's too (only its process 0 writes; see
        # use_compilation_cache).
        if component in CACHED_COMPONENTS:
            use_compilation_cache(cfg)
        try:
            return run(holder["cfg"], args[1:])
        except UsageError as e:  # a setting the component found unusable before starting
            print(f"rlax_tpu.{component}: error: {e}", file=sys.stderr)
            return EXIT_USAGE

    app.run(_main, flags_parser=parse)


def usage(component: str) -> str:
    doc = (sys.modules["__main__"].__doc__ or "").strip()
    return f"""usage: python -m rlax_tpu.{component} [--config=FILE[:PRESET]] [--config.SECTION.FIELD=VALUE ...]

{doc}

flags:
  --config=FILE[:PRESET]   config file in configs/ and an optional preset
                           (default: {_config_flag_default() or "none; required"})
  --config.SECTION.FIELD=VALUE
                           override one field, e.g. --config.trainer.learning_rate=3e-6
                           sections: model, mesh, trainer, inference, param_server, verifiers,
                           data, controller, algorithm (see rlax_tpu/config/ for every field)
  --print_config           print the validated config as JSON and exit
  --helpfull               every absl flag (logging and more)

exit codes: 0 success, 1 run failed (a clear error), {EXIT_USAGE} bad flags or config"""
