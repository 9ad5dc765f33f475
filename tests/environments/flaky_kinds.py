"""What tests/environments/plugin_flaky.py's environment does at a problem's first reply, by the
problem's id (importing this registers nothing: the plugin module registers "flaky" in the
process that imports it)."""

from __future__ import annotations

import zlib


def kind(problem_id: str) -> str:
    """ "raises", "hangs" or "answers": by the id's CRC-32 mod 8 (0, 1, else)."""
    return {0: "raises", 1: "hangs"}.get(zlib.crc32(problem_id.encode()) % 8, "answers")
