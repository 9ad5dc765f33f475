"""The container image's recipe (deploy/docker): a base pinned by digest, a non-root user that is
the one the GKE pods run as, and a build that refuses an unpinned base. (Building the image needs
podman and the network; `make image` does it and checks the user inside.)"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from rlax_tpu.launch import gke

REPO = Path(__file__).resolve().parents[2]
CONTAINERFILE = (REPO / "deploy" / "docker" / "Containerfile").read_text()
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Containerfile, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_the_base_is_pinned_by_digest():
    base = next(rest for word, rest in _instructions(CONTAINERFILE) if word == "ARG")
    name, _, value = base.partition("=")
    assert name == "BASE" and DIGEST.search(value), value
    # The one documented in its comment (docker-library/repo-info's page for that tag).
    assert "debian:bookworm-20260918-slim@sha256:3783cc01" in value
    froms = [rest for word, rest in _instructions(CONTAINERFILE) if word == "FROM"]
    assert froms == ["${BASE}"]


def test_the_image_runs_as_the_non_root_user_the_pods_state():
    users = [rest for word, rest in _instructions(CONTAINERFILE) if word == "USER"]
    assert users, "no USER: the image would run as root"
    uid, _, gid = users[-1].partition(":")
    assert (int(uid), int(gid)) == (gke.RUN_AS_UID, gke.RUN_AS_GID) and int(uid) != 0
    # The user exists in the image with those ids (useradd before the USER line).
    assert f"groupadd --gid {gke.RUN_AS_GID} rlax" in CONTAINERFILE
    assert f"useradd --uid {gke.RUN_AS_UID} --gid {gke.RUN_AS_GID}" in CONTAINERFILE
    words = [w for w, _ in _instructions(CONTAINERFILE)]
    assert words.index("USER") > max(i for i, w in enumerate(words) if w == "RUN")


def _build(base: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("BASE", "REGISTRY")}
    return subprocess.run(
        ["bash", "deploy/docker/build.sh", "localhost/never-built:test"],
        cwd=REPO,
        env={**env, "BASE": base},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "base", ["debian:bookworm-slim", "python:3.11-slim-bookworm", "debian@sha256:1234"]
)
def test_make_image_refuses_a_base_without_a_digest(base):
    """Refused before podman is installed or anything is pulled or built."""
    done = _build(base)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"BASE={base} is not pinned by digest" in done.stderr
    assert "docker buildx imagetools inspect" in done.stderr


def test_the_containerfile_refuses_an_unpinned_base_itself():
    """A build without make image (podman build --build-arg BASE=...) stops at the same check:
    the shell pattern after FROM, run here as the build would run it."""
    check = re.search(r'RUN (case "\$BASE" in .*? esac)', re.sub(r"\\\n", " ", CONTAINERFILE))
    assert check
    pinned = next(r for w, r in _instructions(CONTAINERFILE) if w == "ARG").partition("=")[2]
    for base, ok in ((pinned, True), ("debian:bookworm-slim", False), ("x@sha256:ab", False)):
        done = subprocess.run(["sh", "-c", check.group(1)], env={"BASE": base}, capture_output=True)
        assert (done.returncode == 0) == ok, base


def test_make_image_passes_base_registry_and_tag_through():
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile.split("\nimage:\n", 1)[1].splitlines()[0].strip()
    assert recipe == "BASE='$(BASE)' REGISTRY='$(REGISTRY)' bash deploy/docker/build.sh $(TAG)"
