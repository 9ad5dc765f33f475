"""Shared fixtures: one real verifier service per test session (real bubblewrap and compilers).

Each session runs sandboxes under its own block of uids, so that concurrent test sessions on the
same machine never share an RLIMIT_NPROC budget or see each other's processes.
"""

from __future__ import annotations

import os
import time

import psutil
import pytest

from rlax_tpu.config import VerifierConfig
from rlax_tpu.verifiers.service import VerifierService

WORKERS = 2


def session_uid_base() -> int:
    return 300_000 + (os.getpid() % 100_000) * 8


def make_config(**overrides: object) -> VerifierConfig:
    fields = dict(
        sandbox_uid=session_uid_base(), workers=WORKERS, time_limit_s=1.0, compile_time_limit_s=20.0
    )
    fields.update(overrides)
    return VerifierConfig(**fields)


@pytest.fixture(scope="session")
def service(tmp_path_factory):
    with VerifierService(make_config(), scratch_dir=tmp_path_factory.mktemp("verifier")) as svc:
        yield svc


def sandbox_processes(uids) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["uids"]):
        uids_of = p.info["uids"]
        if uids_of is not None and (uids_of.real in uids or uids_of.effective in uids):
            found.append(p)
    return found


def assert_no_sandbox_processes(uids) -> None:
    for _ in range(50):  # a killed namespace may take a moment to be reaped
        left = sandbox_processes(uids)
        if not left:
            return
        time.sleep(0.1)
    raise AssertionError(f"processes left running as sandbox uids: {[p.pid for p in left]}")


@pytest.fixture()
def no_sandbox_processes():
    return assert_no_sandbox_processes


@pytest.fixture()
def verifier_config():
    """Builds a test VerifierConfig; ``uid_offset`` moves a second service off the shared uids."""

    def build(uid_offset: int = 0, **overrides: object) -> VerifierConfig:
        return make_config(sandbox_uid=session_uid_base() + uid_offset, **overrides)

    return build
