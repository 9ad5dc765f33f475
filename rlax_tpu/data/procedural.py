"""A procedural family of simple stdin/stdout problems that a tiny model can learn from.

Each problem is a template (an operation on the input) with an integer constant K, worded by one of a
few paraphrases. The held-out split uses constants never seen in training (K ≡ 3 mod 7), so a gain on
it is generalization (copying and applying the constant), not memorization of problem ids. The rule
is mod 7, not mod 5 or 10: held-out constants then end in every digit, as training ones do (K ≡ 3 mod
5 would hold out every constant ending in 3 or 8, a digit position training never shows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from rlax_tpu.data.mixture import stream_seed
from rlax_tpu.data.problems import CodeProblem, Solution, TestCase

SOURCE = "procedural"
HELD_OUT_MODULUS, HELD_OUT_RESIDUE = 7, 3  # K % 7 == 3 is held out


@dataclasses.dataclass(frozen=True)
class Template:
    name: str
    statements: tuple[str, ...]  # paraphrases; "{k}" is the constant
    read: str  # how the solution reads its input
    expression: str  # the printed expression; "{k}" is the constant
    make_input: Callable[[np.random.Generator], str]
    answer: Callable[[str, int], str]
    wrong_expression: str  # a plausible bug, for verifier tests
    k_min: int = 0


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split()]


def _one_int(rng: np.random.Generator) -> str:
    return f"{int(rng.integers(-50, 100))}\n"


def _two_ints(rng: np.random.Generator) -> str:
    return f"{int(rng.integers(-50, 100))} {int(rng.integers(-50, 100))}\n"


def _int_list(rng: np.random.Generator) -> str:
    return " ".join(str(int(v)) for v in rng.integers(-20, 60, size=int(rng.integers(1, 6)))) + "\n"


TEMPLATES = (
    Template(
        "add",
        ("Read an integer x. Print x + {k}.", "Given an integer x, output x plus {k}."),
        "x = int(input())",
        "x + {k}",
        _one_int,
        lambda s, k: str(_ints(s)[0] + k),
        "x + {k} + 1",
    ),
    Template(
        "sub",
        ("Read an integer x. Print x - {k}.", "Given an integer x, output x minus {k}."),
        "x = int(input())",
        "x - {k}",
        _one_int,
        lambda s, k: str(_ints(s)[0] - k),
        "{k} - x",
    ),
    Template(
        "mul",
        ("Read an integer x. Print x * {k}.", "Given an integer x, output x times {k}."),
        "x = int(input())",
        "x * {k}",
        _one_int,
        lambda s, k: str(_ints(s)[0] * k),
        "x + {k}",
    ),
    Template(
        "mod",
        (
            "Read an integer x. Print x mod {k}.",
            "Given an integer x, output the remainder of x divided by {k}.",
        ),
        "x = int(input())",
        "x % {k}",
        _one_int,
        lambda s, k: str(_ints(s)[0] % k),
        "x // {k}",
        k_min=2,
    ),
    Template(
        "sum2",
        (
            "Read two integers a and b. Print a + b + {k}.",
            "Given integers a and b, output their sum plus {k}.",
        ),
        "a, b = map(int, input().split())",
        "a + b + {k}",
        _two_ints,
        lambda s, k: str(sum(_ints(s)) + k),
        "a * b + {k}",
    ),
    Template(
        "max",
        (
            "Read a line of integers. Print the largest plus {k}.",
            "Given a list of integers on one line, output the maximum plus {k}.",
        ),
        "a = list(map(int, input().split()))",
        "max(a) + {k}",
        _int_list,
        lambda s, k: str(max(_ints(s)) + k),
        "min(a) + {k}",
    ),
    Template(
        "sumlist",
        (
            "Read a line of integers. Print their sum plus {k}.",
            "Given a list of integers on one line, output the total plus {k}.",
        ),
        "a = list(map(int, input().split()))",
        "sum(a) + {k}",
        _int_list,
        lambda s, k: str(sum(_ints(s)) + k),
        "len(a) + {k}",
    ),
)
TEMPLATE_NAMES = tuple(t.name for t in TEMPLATES)


def is_held_out(k: int) -> bool:
    return k % HELD_OUT_MODULUS == HELD_OUT_RESIDUE


def solution_code(template: Template, k: int) -> str:
    return f"{template.read}\nprint({template.expression.format(k=k)})\n"


def make_problem(
    template: Template, k: int, variant: int, *, num_tests: int = 3, seed: int = 0
) -> CodeProblem:
    """Problem ``<template>/<k>/<variant>`` with ``num_tests`` seeded tests."""
    if k < template.k_min:
        raise ValueError(f"template {template.name!r} needs k >= {template.k_min}, got {k}")
    pid = f"{template.name}/{k}/{variant}"
    rng = np.random.Generator(np.random.PCG64(stream_seed(seed, SOURCE, pid)))
    inputs = [template.make_input(rng) for _ in range(num_tests)]
    statement = template.statements[variant % len(template.statements)].format(k=k)
    wrong = f"{template.read}\nprint({template.wrong_expression.format(k=k)})\n"
    return CodeProblem(
        id=pid,
        title=f"{template.name} {k}",
        statement=statement,
        tests=tuple(TestCase(input=i, output=template.answer(i, k) + "\n") for i in inputs),
        time_limit_s=2.0,
        memory_limit_mb=256,
        reference_solutions=(Solution(language="python", code=solution_code(template, k)),),
        wrong_solutions=(Solution(language="python", code=wrong),),
        source=SOURCE,
    )


def procedural_problems(
    split: str, *, k_max: int = 200, templates: tuple[str, ...] = TEMPLATE_NAMES, seed: int = 0
) -> list[CodeProblem]:
    """All problems of a split: "train" (K not held out) or "test" (held-out K), every paraphrase."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    by_name = {t.name: t for t in TEMPLATES}
    unknown = set(templates) - set(by_name)
    if unknown:
        raise ValueError(f"unknown procedural templates {sorted(unknown)}; known: {TEMPLATE_NAMES}")
    out = []
    for name in templates:
        t = by_name[name]
        for k in range(t.k_min, k_max + 1):
            if is_held_out(k) == (split == "test"):
                out.extend(make_problem(t, k, v, seed=seed) for v in range(len(t.statements)))
    return out
