"""Supported languages: where their toolchains are, how to compile and how to run a program.

Toolchains outside the read-only system directories (pyenv's Python, rustup's sysroot) are found
on the host once and mounted read-only under ``/opt/<name>`` in every sandbox. Paths in commands
are sandbox paths: sources and build outputs live in ``/prog``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from rlax_tpu.verifiers.sandbox import SYSTEM_DIRS, Mount

PROG = "/prog"
JAVA_EXTRA_ADDRESS_SPACE_MB = 2304  # JVM reservations beyond the heap: thread stacks, code cache
JAVA_PROCESSES = 32  # the JVM's own threads (GC, JIT compilers, signal, finalizer...): ~14 here


@dataclasses.dataclass(frozen=True, kw_only=True)
class Language:
    name: str
    source_file: str  # name of the source inside /prog
    compile: tuple[str, ...]  # argv; {src} is the source file name, {mem_mb} the memory limit
    run: tuple[str, ...]  # argv; {mem_mb} is the program's memory limit
    extra_address_space_mb: int = 0
    # RLIMIT_NPROC of a run (threads count too). Small: a run's memory is at most this many
    # times its address-space limit. The unit-test harness needs 2.
    processes: int = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class Toolchains:
    """What this host can compile, and the mounts that make the toolchains visible in sandboxes."""

    languages: dict[str, Language]
    mounts: tuple[Mount, ...]
    missing: dict[str, str]  # language -> why it is unavailable


def _outside_system(path: Path) -> bool:
    return not any(str(path).startswith(d + "/") for d in SYSTEM_DIRS)


def _python() -> tuple[Language, list[Mount]]:
    prefix = Path(sys.base_prefix).resolve()
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    mounts = []
    if _outside_system(prefix):
        mounts.append(Mount(prefix, "/opt/python"))
        prefix = Path("/opt/python")
    exe = str(prefix / "bin" / version)
    # A syntax check is the "compilation": syntax errors become compile errors.
    check = "import sys; compile(open(sys.argv[1], 'rb').read(), sys.argv[1], 'exec')"
    lang = Language(
        name="python",
        source_file="main.py",
        compile=(exe, "-I", "-S", "-c", check, f"{PROG}/{{src}}"),
        run=(exe, "-I", "-S", f"{PROG}/main.py"),
    )
    return lang, mounts


def _cpp() -> tuple[Language, list[Mount]]:
    gxx = shutil.which("g++")
    if gxx is None:
        raise FileNotFoundError("g++ is not installed")
    return Language(
        name="cpp",
        source_file="main.cpp",
        compile=("g++", "-std=gnu++17", "-O2", "-pipe", "-o", f"{PROG}/main", f"{PROG}/{{src}}"),
        run=(f"{PROG}/main",),
    ), []


def _rust() -> tuple[Language, list[Mount]]:
    rustc = shutil.which("rustc")
    if rustc is None:
        raise FileNotFoundError("rustc is not installed")
    sysroot = subprocess.run(
        [rustc, "--print", "sysroot"], capture_output=True, text=True, timeout=60, check=True
    ).stdout.strip()
    root = Path(sysroot).resolve()
    mounts = []
    if _outside_system(root):
        mounts.append(Mount(root, "/opt/rust"))
        root = Path("/opt/rust")
    return Language(
        name="rust",
        source_file="main.rs",
        compile=(
            str(root / "bin" / "rustc"),
            "--edition",
            "2021",
            "-O",
            "-C",
            "codegen-units=1",
            "-o",
            f"{PROG}/main",
            f"{PROG}/{{src}}",
        ),
        run=(f"{PROG}/main",),
    ), mounts


def _java() -> tuple[Language, list[Mount]]:
    java = shutil.which("java")
    javac = shutil.which("javac")
    if java is None or javac is None:
        raise FileNotFoundError("java/javac are not installed")
    home = Path(os.path.realpath(javac)).parent.parent
    mounts = []
    if _outside_system(home):
        mounts.append(Mount(home, "/opt/java"))
        home = Path("/opt/java")
    # Small fixed reservations so that the JVM fits under RLIMIT_AS (its defaults reserve >1 GiB).
    jvm = (
        "-XX:+UseSerialGC",
        "-XX:CompressedClassSpaceSize=64m",
        "-XX:ReservedCodeCacheSize=64m",
        "-Xshare:auto",
    )
    return Language(
        name="java",
        source_file="Main.java",
        compile=(
            str(home / "bin" / "javac"),
            "-J-Xmx{mem_mb}m",
            "-J-XX:TieredStopAtLevel=1",
            *(f"-J{f}" for f in jvm),
            "-encoding",
            "UTF-8",
            "-nowarn",
            "-d",
            PROG,
            f"{PROG}/{{src}}",
        ),
        run=(
            str(home / "bin" / "java"),
            "-Xmx{mem_mb}m",
            "-Xss64m",
            *jvm,
            "-cp",
            PROG,
            "Main",
        ),
        extra_address_space_mb=JAVA_EXTRA_ADDRESS_SPACE_MB,
        processes=JAVA_PROCESSES,
    ), mounts


_FINDERS = {"python": _python, "cpp": _cpp, "rust": _rust, "java": _java}
# Problems' special checkers (testlib) are C++ whatever language submissions are in, so the
# verifier always looks for this toolchain; ``verifiers.languages`` limits submissions only.
CHECKER_LANGUAGES = ("cpp",)


def detect(names: tuple[str, ...]) -> Toolchains:
    languages, mounts, missing = {}, [], {}
    for name in names:
        try:
            lang, extra = _FINDERS[name]()
        except (OSError, subprocess.SubprocessError) as e:
            missing[name] = str(e)
            continue
        languages[name] = lang
        mounts += [m for m in extra if m not in mounts]
    return Toolchains(languages=languages, mounts=tuple(mounts), missing=missing)


_JAVA_PUBLIC_CLASS = re.compile(r"public\s+(?:final\s+|abstract\s+)*class\s+([A-Za-z_$][\w$]*)")


def source_and_run(language: Language, code: str) -> tuple[str, tuple[str, ...]]:
    """(source file name, run argv) for ``code``: Java's public class may have any name."""
    if language.name != "java":
        return language.source_file, language.run
    m = _JAVA_PUBLIC_CLASS.search(code)
    cls = m.group(1) if m else "Main"
    return f"{cls}.java", tuple(cls if a == "Main" else a for a in language.run)


def fill(argv: tuple[str, ...], **values: object) -> list[str]:
    return [a.format(**values) if "{" in a else a for a in argv]
