"""From problems to prompts, and from completions to verifier tasks and rewards.

Two prompt styles:
  * ``raw`` (tiny models trained here): the statement, then an opened code fence; the model writes
    the program and closes the fence. The program is the text before the first closing fence.
  * ``chat`` (instruct models): a ChatML conversation asking for one fenced program; the program
    is the last fenced block of the answer. For a function to complete (HumanEval layout) it is the
    last block that defines the function (models often end with a usage example), else the last
    block; its top-level imports, definitions and assignments run after the problem's own prompt
    (its imports and helpers), its usage lines do not. An answer with no fenced block (or only an
    unclosed one, cut by the token limit) runs nothing and earns the compile-error reward.
"""

from __future__ import annotations

import ast
import re
import textwrap
import threading
from collections.abc import Sequence
from typing import Literal, Protocol

from rlax_tpu.data.problems import CodeProblem, MathProblem, Problem, UnitTestProblem
from rlax_tpu.types import Verdict, VerdictKind
from rlax_tpu.verifiers.api import CodeTask, MathTask, ProblemSpec, Task, UnitTestTask
from rlax_tpu.verifiers.problems import Uploader, upload_problem

PromptStyle = Literal["raw", "chat"]
FENCE = "```"
_LANG_TAGS = {"python": "python", "cpp": "cpp", "rust": "rust", "java": "java"}
_CODE_SYSTEM = (
    "You are an expert competitive programmer. Answer with one complete program in a code block."
)
_FUNCTION_SYSTEM = (
    "You are an expert Python programmer. Answer with the complete function in one code block."
)
# A math question must not be framed as a programming task: under the code system prompt
# SmolLM2-135M answered arithmetic with programs and never stated an answer (issue [real-model]).
_MATH_SYSTEM = (
    "You are a careful math assistant. Work the problem out, then state the final answer."
)
_FENCED = re.compile(r"```[A-Za-z0-9+]*\r?\n(.*?)```", re.S)


class TextTokenizer(Protocol):
    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]: ...

    def apply_chat_template(self, messages: Sequence[dict[str, str]], **kwargs: object) -> str: ...


def prompt_text(
    problem: Problem,
    *,
    style: PromptStyle,
    language: str = "python",
    tokenizer: TextTokenizer | None = None,
    instructions: str = "",
) -> str:
    """The text the model continues; ``instructions`` (an environment's: how to call its tools)
    end the chat style's user turn."""
    tag = _LANG_TAGS[language]
    if isinstance(problem, CodeProblem):
        body = problem.statement
        ask = f"Write a {language} program that reads standard input and writes standard output."
    elif isinstance(problem, UnitTestProblem):
        body, ask = problem.prompt, "Complete the function."
    else:
        body, ask = problem.question, "Give the final answer as: Answer: <answer>"
    if style == "raw":
        if isinstance(problem, MathProblem):
            return f"{body}\nAnswer:"
        if isinstance(problem, UnitTestProblem):
            return body
        return f"{body}\n{FENCE}{tag}\n"
    if tokenizer is None:
        raise ValueError("the chat prompt style needs a tokenizer with a chat template")
    system = (
        _MATH_SYSTEM
        if isinstance(problem, MathProblem)
        else _FUNCTION_SYSTEM
        if isinstance(problem, UnitTestProblem)
        else _CODE_SYSTEM
    )
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "\n\n".join(t for t in (body, ask, instructions) if t)},
    ]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def extract_program(completion: str, *, style: PromptStyle) -> str | None:
    """The program in a completion, or None if there is none to run."""
    if style == "raw":
        code = completion.split(FENCE, 1)[0]
        return code if code.strip() else None
    blocks = _FENCED.findall(completion)
    return blocks[-1] if blocks else None


def extract_function(completion: str, entry_point: str) -> str | None:
    """The fenced block of a chat answer that defines ``entry_point`` at its top level once
    dedented (the last such; a block under a list item is indented), else the last non-empty
    block; None if no fenced block holds code."""
    blocks = [b for b in _FENCED.findall(completion) if b.strip()]
    if not blocks:
        return None
    defines = re.compile(rf"^(async\s+)?def\s+{re.escape(entry_point)}\s*\(", re.M)
    return next((b for b in reversed(blocks) if defines.search(textwrap.dedent(b))), blocks[-1])


# What a block keeps of its top level when it is graded as a function: the answer's own usage
# lines (prints, input(), asserts, `if __name__ == ...`) are not the function and would fail
# a right one (evalplus's sanitizer keeps the same kinds of statement).
_DEFINITIONS = (
    ast.Import,
    ast.ImportFrom,
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
    ast.Assign,
    ast.AnnAssign,
)


# CPython 3.11's ast.parse keeps its recursion depth in the interpreter's shared AST state, and
# parses in two threads at once can fail with "SystemError: AST constructor recursion depth
# mismatch" (python/cpython gh-106905). The controller verifies in threads, and a repair run
# died of it (benchmarks/RESULTS.md, multi-turn): its parses take turns.
_PARSE_LOCK = threading.Lock()


def parse_python(code: str) -> ast.Module:
    """``ast.parse``, one thread at a time (see _PARSE_LOCK). Raises SyntaxError."""
    with _PARSE_LOCK:
        return ast.parse(code)


def _definitions(code: str) -> str:
    """``code``'s top-level imports, definitions and assignments, in order; ``code`` unchanged if
    it does not parse (the syntax check reports it) or holds none of them."""
    try:
        tree = parse_python(code)
    except SyntaxError:
        return code
    lines = code.splitlines(keepends=True)
    kept = []
    for node in tree.body:
        if isinstance(node, _DEFINITIONS):
            decorators = getattr(node, "decorator_list", [])
            start = min([node.lineno, *(d.lineno for d in decorators)])
            kept.append("".join(lines[start - 1 : node.end_lineno]).rstrip("\n") + "\n")
    return "".join(kept) if kept else code


def unit_test_code(problem: UnitTestProblem, completion: str) -> str | None:
    """The program a chat answer to a function problem makes, or None if it holds no code: the
    problem's prompt (its imports, helpers and the stub), then the chosen block's definitions,
    which redefine the function. A block of indented lines that defines nothing is the body: it
    completes the stub."""
    block = extract_function(completion, problem.entry_point)
    if block is None:
        return None
    dedented = textwrap.dedent(block)
    if dedented != block and not re.search(r"^(async\s+)?(def|class)\s", dedented, re.M):
        return problem.prompt + block
    return f"{problem.prompt}\n{_definitions(dedented)}"


class SpecCache:
    """Uploads each problem's tests and checker once and remembers the links (ProblemSpec)."""

    def __init__(self, uploader: Uploader):
        self._uploader = uploader
        self._specs: dict[str, ProblemSpec] = {}

    def spec(self, problem: CodeProblem) -> ProblemSpec:
        if problem.id not in self._specs:
            checker = problem.checker
            self._specs[problem.id] = upload_problem(
                self._uploader,
                problem_id=problem.id,
                tests=[(t.input, t.output) for t in problem.tests],
                checker_source=checker.source if checker else "",
                checker_language=checker.language if checker else "cpp",
                time_limit_s=problem.time_limit_s,
                memory_limit_mb=problem.memory_limit_mb,
            )
        return self._specs[problem.id]


def make_task(
    problem: Problem,
    completion: str,
    *,
    style: PromptStyle,
    specs: SpecCache,
    language: str = "python",
) -> Task | None:
    """The verifier task for one completion; None when it holds no program (reward 0, no run)."""
    if isinstance(problem, MathProblem):
        # The raw prompt ends with "Answer:", which the extractor needs to see.
        response = f"Answer:{completion}" if style == "raw" else completion
        return MathTask(response=response, answer=problem.answer)
    if isinstance(problem, UnitTestProblem):
        if style == "raw":
            code = problem.prompt + completion
        else:
            code = unit_test_code(problem, completion)
            if code is None:
                return None
        return UnitTestTask(code=code, test=problem.test, entry_point=problem.entry_point)
    program = extract_program(completion, style=style)
    if program is None:
        return None
    return CodeTask(problem=specs.spec(problem), language=language, code=program)


NO_PROGRAM = Verdict(kind=VerdictKind.COMPILE_ERROR, detail="no program in the completion")
