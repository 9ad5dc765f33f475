"""The start-up row check of the shared engine/replay programs catches a row-dependent program.

Whether this host's XLA:CPU rounds every row alike is not asserted here (the code does not
promise it on every host; it checks and reports). What is asserted: the check reports a row
whose bits differ, through the decode program or the prefill program, and the engine turns
that into its tolerance mode (one warning, ``rows_bitwise`` False)."""

from __future__ import annotations

import dataclasses
import logging

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlax_tpu import models
from rlax_tpu.config import InferenceConfig
from rlax_tpu.inference import engine as engine_lib
from rlax_tpu.models import programs
from rlax_tpu.models.scoring import rows_bitwise

ICFG = InferenceConfig(
    max_concurrent_seqs=4,
    page_size=4,
    kv_cache_bytes=2**20,
    max_prompt_len=12,
    max_new_tokens=4,
    prefill_rows=2,
    prefill_len=5,
)


@pytest.fixture(scope="module")
def model() -> models.Transformer:
    return models.init_model(models.preset("tiny"), seed=2)


def _check(model: models.Transformer) -> bool:
    shape = models.ReplayShape.of_engine(ICFG, model.cfg)
    graphdef, state = nnx.split(model)
    ok, cache = programs.rows_are_independent(
        state,
        shape.make_cache(model.cfg),
        graphdef=graphdef,
        prefill_rows=shape.prefill_rows,
        prefill_len=shape.prefill_len,
    )
    assert np.isfinite(np.asarray(cache.k_pages)).all()  # the pages it wrote stay readable
    assert rows_bitwise(model, shape) == ok  # the replay's entry point runs the same check
    return ok


def _one_ulp_up(x: jnp.ndarray, row: int) -> jnp.ndarray:
    return x.at[row].set(jnp.nextafter(x[row], jnp.inf))


def _last_row_rounds_differently(monkeypatch: pytest.MonkeyPatch) -> None:
    real = programs.decode_program

    def decode(*args, **kwargs):
        out, cache = real(*args, **kwargs)
        key = "logprob_temperature_scaled"
        return {**out, key: _one_ulp_up(out[key], out[key].shape[0] - 1)}, cache

    monkeypatch.setattr(programs, "decode_program", decode)


def test_check_reports_a_decode_row_rounded_by_its_index(model, monkeypatch):
    _last_row_rounds_differently(monkeypatch)
    assert not _check(model)


def test_check_reports_a_prefill_row_rounded_by_its_index(model, monkeypatch):
    real = programs.prefill_program

    def prefill(state, cache, tokens, positions, tables, *, graphdef):
        out, experts = real(state, cache, tokens, positions, tables, graphdef=graphdef)
        if int(np.asarray(positions)[-1, 0]) >= 0:  # the chunk sits in the last row
            out = dataclasses.replace(out, k_pages=_one_ulp_up(out.k_pages, 0))
        return out, experts

    monkeypatch.setattr(programs, "prefill_program", prefill)
    assert not _check(model)


def test_engine_warns_once_and_reports_tolerance_mode(model, monkeypatch, caplog):
    _last_row_rounds_differently(monkeypatch)
    engine_lib._warn_rows_not_bitwise.cache_clear()
    with caplog.at_level(logging.WARNING, logger=engine_lib.__name__):
        engines = [engine_lib.Engine(model, ICFG) for _ in range(2)]
    assert [e.stats().rows_bitwise for e in engines] == [False, False]
    warnings = [r for r in caplog.records if "round-off" in r.getMessage()]
    assert len(warnings) == 1
