"""The docs' configuration reference lists every flag, each with what it does, and is current."""

from __future__ import annotations

import re
from pathlib import Path

from rlax_tpu import config_reference

REPO = Path(__file__).resolve().parents[1]


def test_every_flag_has_a_comment_saying_what_it_does():
    flags = config_reference.fields()
    assert len(flags) > 200
    assert [f for f, _, comment in flags if len(comment) < 10] == []


def test_the_docs_reference_is_current():
    text = (REPO / config_reference.PAGE).read_text()
    start = text.index(config_reference.BEGIN)
    end = text.index(config_reference.END) + len(config_reference.END)
    assert text[start:end] == config_reference.reference(), (
        f"{config_reference.PAGE}'s flag reference is stale: run `python -m rlax_tpu.config_reference`"
    )
    for flag, _, _ in config_reference.fields():
        assert f"| `{flag}` |" in text


def test_every_flag_is_read_outside_the_config_module():
    # A flag no code reads is accepted and ignored. (By name: a field named like another
    # section's passes on the other's use, so this catches a flag whose last reader went.)
    code = "\n".join(
        p.read_text()
        for p in (REPO / "rlax_tpu").rglob("*.py")
        if p.parent.name != "config" and p.name != "config_reference.py"
    )
    unread = [
        flag
        for flag, _, _ in config_reference.fields()
        if not re.search(rf"\b{flag.rsplit('.', 1)[-1]}\b", code)
    ]
    assert unread == []
