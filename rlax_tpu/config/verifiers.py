"""The verifiers section: languages, sandbox limits and the service."""

from __future__ import annotations

import math
from typing import Literal

from rlax_tpu.config.checks import bad, check_address, frozen, positive

LANGUAGES = ("python", "cpp", "rust", "java")


@frozen
class VerifierConfig:
    address: str = "127.0.0.1:0"  # gRPC address the verifier service serves on
    auth_token_file: str = ""  # file holding the token callers must present; needed off loopback
    tls_cert_file: str = ""  # PEM certificate and key to serve TLS with; '' plain
    languages: tuple[str, ...] = LANGUAGES  # languages it compiles and runs
    workers: int = 2  # sandboxes running at once
    max_pending: int = 1024  # backpressure: requests queued beyond this are refused
    time_limit_s: float = 2.0  # default per test when the problem gives none
    memory_limit_mb: int = 256  # default memory per program when the problem gives none
    compile_time_limit_s: float = 30.0  # time limit of one compilation
    max_output_bytes: int = 1 << 20  # a program's output beyond this is an output-limit verdict
    # Worker slot i runs untrusted code as uid sandbox_uid + i (RLIMIT_NPROC counts per uid and
    # does not bind root, so each slot gets its own non-root uid). A dedicated range far from
    # system users and `nobody` (65534), whose processes would share the RLIMIT_NPROC budget.
    sandbox_uid: int = 200_000
    testlib_path: str = ""  # testlib.h for problems' own checkers; "" = none available
    request_deadline_s: float = 120.0  # a verify call's default deadline
    compile_memory_limit_mb: int = 2048  # compilers (rustc, javac) need far more than programs
    # Python's syntax check: in a long-lived unprivileged helper process ("helper": compile() runs
    # no code) or one sandbox run per program ("sandbox", ~17 ms each).
    python_check: Literal["helper", "sandbox"] = "helper"
    disk_limit_mb: int = 64  # size of each sandbox's private /work and /tmp (tmpfs, in RAM)
    seccomp: bool = True  # deny kernel attack surface (ptrace, mount, namespaces...) on x86_64
    # Bound each run's memory (all its processes) with a memory cgroup where the host allows
    # it; elsewhere, or False, a run is judged by its peak RSS (docs/configuration.md: Verifier sandbox).
    memory_cgroups: bool = True
    repository_dir: str = ""  # content-addressed test data; "" = a private temporary directory
    # Limits a request may ask for (per test / per unit-test program); larger ones are clamped.
    max_time_limit_s: float = 20.0
    max_memory_limit_mb: int = 1024  # largest memory limit a request may ask for

    def __post_init__(self) -> None:
        positive(
            self,
            "workers",
            "max_pending",
            "time_limit_s",
            "memory_limit_mb",
            "compile_time_limit_s",
            "max_output_bytes",
            "request_deadline_s",
            "compile_memory_limit_mb",
            "disk_limit_mb",
            "max_time_limit_s",
            "max_memory_limit_mb",
        )
        if not math.isfinite(self.max_time_limit_s) or self.max_time_limit_s < self.time_limit_s:
            raise bad(
                self,
                "max_time_limit_s",
                f"must be finite and >= time_limit_s ({self.time_limit_s})",
            )
        if self.max_memory_limit_mb < self.memory_limit_mb:
            raise bad(
                self, "max_memory_limit_mb", f"must be >= memory_limit_mb ({self.memory_limit_mb})"
            )
        if not self.languages:
            raise bad(self, "languages", "must name at least one language")
        for lang in self.languages:
            if lang not in LANGUAGES:
                raise bad(
                    self,
                    "languages",
                    f"unknown language {lang!r}; supported: {', '.join(LANGUAGES)}",
                )
        if self.sandbox_uid == 0:
            raise bad(self, "sandbox_uid", "must not be 0: untrusted code never runs as root")
        if not 0 < self.sandbox_uid <= 2**31 - 1 - self.workers:
            raise bad(
                self,
                "sandbox_uid",
                "must be > 0 and leave room for one uid per worker (sandbox_uid + workers < 2^31)",
            )
        if self.sandbox_uid < 1000:
            raise bad(self, "sandbox_uid", "must be >= 1000 (below are system users and daemons)")
        if self.sandbox_uid <= 65535 and self.sandbox_uid + self.workers > 65534:
            raise bad(
                self,
                "sandbox_uid",
                f"uids {self.sandbox_uid}..{self.sandbox_uid + self.workers - 1} (one per worker) "
                "must not include 65534 (nobody) or 65535 (-1 as a 16-bit uid)",
            )
        check_address(self, "address", self.auth_token_file, self.tls_cert_file)
