from __future__ import annotations

import contextlib
import io

import pytest

from rlax_tpu.data.procedural import TEMPLATES, is_held_out, make_problem, procedural_problems


def run_trusted(code: str, stdin: str) -> str:
    """Runs our own reference code in-process (trusted; model output always goes to the sandbox)."""
    lines = iter(stdin.splitlines())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {"input": lambda: next(lines)})  # noqa: S102
    return out.getvalue()


def test_splits_are_disjoint_in_the_constant():
    train, test = procedural_problems("train"), procedural_problems("test")
    k_of = lambda p: int(p.id.split("/")[1])  # noqa: E731
    assert train and test
    assert not {k_of(p) for p in train} & {k_of(p) for p in test}
    assert all(is_held_out(k_of(p)) for p in test) and not any(is_held_out(k_of(p)) for p in train)
    assert len({p.id for p in train + test}) == len(train) + len(test)
    assert {p.id.split("/")[0] for p in test} == {t.name for t in TEMPLATES}
    # Held-out constants end in every digit, so none sits in a digit position training never shows.
    assert {k_of(p) % 10 for p in test} == set(range(10))


def test_reference_solutions_pass_and_wrong_ones_fail_every_test():
    for p in procedural_problems("train", k_max=12) + procedural_problems("test", k_max=12):
        (ref,) = p.reference_solutions
        (wrong,) = p.wrong_solutions
        assert [run_trusted(ref.code, t.input) for t in p.tests] == [t.output for t in p.tests], (
            p.id
        )
        assert [run_trusted(wrong.code, t.input) for t in p.tests] != [t.output for t in p.tests], (
            p.id
        )


def test_generation_is_seeded():
    t = TEMPLATES[0]
    assert make_problem(t, 7, 0, seed=1) == make_problem(t, 7, 0, seed=1)
    assert make_problem(t, 7, 0, seed=1).tests != make_problem(t, 7, 0, seed=2).tests
    assert "x + 7" in make_problem(t, 7, 0).statement


def test_bad_arguments():
    with pytest.raises(ValueError, match="split must be"):
        procedural_problems("valid")
    with pytest.raises(ValueError, match="unknown procedural templates"):
        procedural_problems("train", templates=("nope",))
    mod = next(t for t in TEMPLATES if t.name == "mod")
    with pytest.raises(ValueError, match="needs k >= 2"):
        make_problem(mod, 1, 0)
