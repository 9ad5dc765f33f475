"""Bundled Codeforces-style problems in every language, and the checker protocol's corners."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from rlax_tpu.types import VerdictKind
from rlax_tpu.verifiers.api import CodeTask
from rlax_tpu.verifiers.problems import bundled_problems, upload_files, upload_problem
from rlax_tpu.verifiers.service import VerifierService

FAKE_TESTLIB = Path(__file__).parent / "fixtures" / "fake_testlib" / "testlib.h"
TESTLIB_CHECKER = """#include "testlib.h"
int main(int argc, char** argv) {
  return read_first_token(argv[2]) == read_first_token(argv[3]) ? 0 : 1;
}
"""


def test_bundled_problems_in_every_language(service):
    problems = bundled_problems()
    assert len(problems) >= 4
    tasks, expected = [], []
    for problem in problems:
        spec = upload_files(service, problem)
        assert spec.checker or problem.checker_source == ""
        languages = {s.language for s in problem.solutions if s.verdict == "accepted"}
        assert languages == {"python", "cpp", "rust", "java"}, problem.id
        assert any(s.verdict != "accepted" for s in problem.solutions), problem.id
        for s in problem.solutions:
            tasks.append(CodeTask(problem=spec, language=s.language, code=s.code))
            expected.append((problem.id, s.language, s.note, s.verdict))
    verdicts = service.verify(tasks)
    got = [(*e[:3], v.kind.value) for e, v in zip(expected, verdicts, strict=True)]
    assert got == [(*e[:3], e[3]) for e in expected]
    for v, e in zip(verdicts, expected, strict=True):
        assert (v.tests_passed == v.tests_total) == (e[3] == "accepted")


def test_special_checker_accepts_an_answer_other_than_the_jury_answer(service):
    [problem] = [p for p in bundled_problems() if p.id == "any_divisor"]
    assert problem.tests[0] == ("12\n", "6\n")
    spec = upload_files(service, problem)
    # Prints the largest divisor below the jury's (3 for 12, not 6): right, yet not the answer file.
    code = (
        "n = int(input())\n"
        "ds = [d for d in range(2, int(n ** 0.5) + 1) if n % d == 0]\n"
        "print(n // ds[0] // (ds[0] if n // ds[0] > ds[0] and n // ds[0] % ds[0] == 0 and "
        "n // ds[0] // ds[0] > 1 else 1) if ds else -1)\n"
    )
    [verdict] = service.verify([CodeTask(problem=spec, language="python", code=code)])
    assert verdict.kind is VerdictKind.ACCEPTED, verdict
    no_checker = upload_problem(service, problem_id="plain", tests=problem.tests[:1])
    [plain] = service.verify([CodeTask(problem=no_checker, language="python", code=code)])
    assert plain.kind is VerdictKind.WRONG_ANSWER
    assert plain.detail == "test 1: token 1: expected '6', got '3'"


def test_uploads_are_content_addressed(service):
    link = service.upload(b"1 2\n")
    assert link == service.upload(b"1 2\n") and link.startswith("sha256:")
    assert service.missing([link, "sha256:" + "0" * 64]) == ["sha256:" + "0" * 64]
    assert service.repository.read(link) == b"1 2\n"


def test_missing_links_are_an_internal_error_not_a_model_failure(service):
    spec = upload_problem(service, problem_id="p", tests=[("1\n", "1\n")])
    broken = spec.__class__(
        problem_id="p",
        tests=(spec.tests[0].__class__(input="sha256:" + "1" * 64, answer=spec.tests[0].answer),),
    )
    [verdict] = service.verify([CodeTask(problem=broken, language="python", code="print(1)")])
    assert verdict.kind is VerdictKind.INTERNAL_ERROR and not verdict.is_model_failure


@pytest.mark.parametrize(
    ("exit_code", "kind", "score"),
    [
        (3, VerdictKind.INTERNAL_ERROR, 0.0),
        (2, VerdictKind.PRESENTATION_ERROR, 0.0),
        (7, VerdictKind.WRONG_ANSWER, 0.25),
    ],
)
def test_checker_exit_codes(service, exit_code, kind, score):
    checker = (
        f"import sys\nprint('points 0.25 partly right', file=sys.stderr)\nsys.exit({exit_code})\n"
    )
    spec = upload_problem(
        service,
        problem_id="codes",
        tests=[("1\n", "1\n")],
        checker_source=checker,
        checker_language="python",
    )
    [verdict] = service.verify([CodeTask(problem=spec, language="python", code="print(1)")])
    assert verdict.kind is kind
    assert verdict.score == pytest.approx(score)
    assert verdict.is_model_failure == (kind is not VerdictKind.INTERNAL_ERROR)


def test_testlib_checker_without_testlib_is_a_clear_error(service):
    spec = upload_problem(
        service, problem_id="needs_testlib", tests=[("1\n", "1\n")], checker_source=TESTLIB_CHECKER
    )
    [verdict] = service.verify([CodeTask(problem=spec, language="python", code="print(1)")])
    assert verdict.kind is VerdictKind.INTERNAL_ERROR
    assert "testlib.h" in verdict.detail and "verifiers.testlib_path" in verdict.detail


def test_testlib_checker_with_testlib_shipped_by_the_problem(service):
    spec = upload_problem(
        service,
        problem_id="ships_testlib",
        tests=[("1\n", "1\n")],
        checker_source=TESTLIB_CHECKER,
        testlib_source=FAKE_TESTLIB.read_text(),
    )
    ok, wrong = service.verify(
        [CodeTask(problem=spec, language="python", code=c) for c in ("print(1)", "print(2)")]
    )
    assert ok.kind is VerdictKind.ACCEPTED and wrong.kind is VerdictKind.WRONG_ANSWER


def test_testlib_checker_with_configured_testlib_path(tmp_path, verifier_config):
    config = verifier_config(4, testlib_path=str(FAKE_TESTLIB), languages=("python", "cpp"))
    with VerifierService(config, scratch_dir=tmp_path) as svc:
        spec = upload_problem(
            svc, problem_id="configured", tests=[("1\n", "1\n")], checker_source=TESTLIB_CHECKER
        )
        [verdict] = svc.verify([CodeTask(problem=spec, language="python", code="print(1)")])
    assert verdict.kind is VerdictKind.ACCEPTED


def test_partial_points_add_up_to_the_mean_over_tests(service):
    """A points checker's scores are summed over all tests, not cut at the first partial one."""
    checker = textwrap.dedent("""\
        import sys
        out = open(sys.argv[2]).read().split()
        points = {"full": 1.0, "half": 0.5, "none": 0.0}[out[0]]
        if points == 1.0:
            sys.exit(0)
        print(f"points {points}", file=sys.stderr)
        sys.exit(7)
    """)
    spec = upload_problem(
        service,
        problem_id="points",
        checker_source=checker,
        checker_language="python",
        tests=[
            ("half\n", "-\n"),
            ("full\n", "-\n"),
            ("half\n", "-\n"),
            ("none\n", "-\n"),
            ("full\n", "-\n"),
        ],
    )
    [verdict] = service.verify([CodeTask(problem=spec, language="python", code="print(input())")])
    assert verdict.kind is VerdictKind.WRONG_ANSWER and verdict.detail.startswith("test 1:")
    # 0.5 + 1 + 0.5 + 0 (a failure without points: test 5 is skipped) over 5 tests.
    assert verdict.score == pytest.approx(2.0 / 5)
    assert verdict.tests_passed == 0 and verdict.tests_total == 5


THREADS = {
    "python": textwrap.dedent("""\
        import sys, threading
        from concurrent.futures import ThreadPoolExecutor
        sys.setrecursionlimit(10 ** 6)
        a, b = map(int, input().split())
        def deep(n):
            return 0 if n == 0 else 1 + deep(n - 1)
        with ThreadPoolExecutor(4) as pool:
            parts = list(pool.map(lambda x: x, [a, b]))
        t = threading.Thread(target=lambda: None)
        t.start(); t.join()
        print(sum(parts) + deep(100000) - 100000)
    """),
    "cpp": textwrap.dedent("""\
        #include <cstdio>
        #include <thread>
        int deep(int n) { volatile char pad[200]; pad[0] = 0; return n == 0 ? pad[0] : 1 + deep(n - 1); }
        int main() {
          long long a, b, s = 0;
          if (scanf("%lld %lld", &a, &b) != 2) return 1;
          std::thread t([&] { s = a + b; });
          t.join();
          printf("%lld\\n", s + deep(400000) - 400000);  // ~100 MB of main-thread stack
        }
    """),
    "rust": textwrap.dedent("""\
        use std::io::Read;
        fn deep(n: u64) -> u64 { let pad = [n as u8; 64]; if n == 0 { pad[0] as u64 } else { 1 + deep(n - 1) + (pad[63] as u64) * 0 } }
        fn main() {
            let mut s = String::new();
            std::io::stdin().read_to_string(&mut s).unwrap();
            let v: Vec<i64> = s.split_whitespace().map(|x| x.parse().unwrap()).collect();
            let (a, b) = (v[0], v[1]);
            let sum = std::thread::spawn(move || a + b).join().unwrap();
            println!("{}", sum + deep(200000) as i64 - 200000);
        }
    """),
    "java": textwrap.dedent("""\
        import java.util.*;
        import java.util.concurrent.*;
        public class Main {
            public static void main(String[] args) throws Exception {
                Scanner in = new Scanner(System.in);
                long a = in.nextLong(), b = in.nextLong();
                ExecutorService pool = Executors.newFixedThreadPool(2);
                Future<Long> f = pool.submit(() -> a + b);
                System.out.println(f.get());
                pool.shutdown();
            }
        }
    """),
}


HOGS = {  # 600 MB, over the 256 MB limit
    "python": "x = bytearray(600 * 2**20)\nprint(3)",
    "cpp": "#include <cstdio>\n#include <cstdlib>\n#include <cstring>\nint main(){"
    'char* p=(char*)malloc(600u<<20); if(!p) return 3; memset(p,1,600u<<20); puts("3");}',
}


@pytest.mark.parametrize("language", sorted(THREADS))
def test_programs_that_start_threads_and_recurse_deeply_are_accepted(service, language):
    """At the default 256 MB, in every language: threads get ordinary stacks (the stack limit
    used to equal the memory limit, so each new thread reserved 256 MB of address space and
    failed: Python's "can't start new thread", C++'s SIGABRT), while the main thread may still
    recurse deep (~100 MB in C++); a program over the memory limit still fails."""
    spec = upload_problem(
        service, problem_id=f"threads-{language}", tests=[("1 2\n", "3\n"), ("40 2\n", "42\n")]
    )
    [verdict] = service.verify([CodeTask(problem=spec, language=language, code=THREADS[language])])
    assert verdict.kind is VerdictKind.ACCEPTED, verdict
    if language in HOGS:
        [over] = service.verify([CodeTask(problem=spec, language=language, code=HOGS[language])])
        assert over.kind is not VerdictKind.ACCEPTED, over


# Memory by what a program holds. RESERVERS reserve far more address space than they touch (many
# threads with their stacks and malloc arenas; a large untouched allocation): judges accept them,
# and RLIMIT_AS at the limit did not. TOUCHERS hold 300 MB of a 256 MB limit.
RESERVERS = {
    "python": textwrap.dedent("""\
        import mmap, threading
        a, b = map(int, input().split())
        reserve = mmap.mmap(-1, 300 << 20)  # anonymous, never touched
        barrier = threading.Barrier(5)
        ts = [threading.Thread(target=barrier.wait) for _ in range(4)]
        for t in ts: t.start()
        barrier.wait()
        for t in ts: t.join()
        print(a + b + len(reserve) - (300 << 20))
    """),
    "cpp": textwrap.dedent("""\
        #include <cstdio>
        #include <cstdlib>
        #include <thread>
        #include <vector>
        int main() {
          long long a, b;
          if (scanf("%lld %lld", &a, &b) != 2) return 1;
          char* reserve = (char*)malloc(300u << 20);  // mmap'd, never touched
          if (!reserve) return 3;
          std::vector<std::thread> ts;
          for (int i = 0; i < 6; ++i) ts.emplace_back([] { volatile int x = 0; (void)x; });
          for (auto& t : ts) t.join();
          printf("%lld\\n", a + b);
        }
    """),
}
TOUCHERS = {
    "python": "x = bytearray(300 * 2**20)\nprint(3)",
    # Volatile stores to every page: the compiler may not drop the allocation.
    "cpp": "#include <cstdio>\n#include <cstdlib>\nint main(){const unsigned long n=300ul<<20;"
    "volatile char* p=(volatile char*)malloc(n); if(!p)return 3;"
    'for(unsigned long i=0;i<n;i+=4096)p[i]=1; printf("%d\\n",p[n-4096]+2);}',
}


@pytest.mark.parametrize("cgroups", [True, False], ids=["cgroup", "peak_rss"])
def test_memory_is_what_a_program_holds_not_what_it_reserves(verifier_config, tmp_path, cgroups):
    config = verifier_config(20, languages=("python", "cpp"), memory_cgroups=cgroups)
    with VerifierService(config, scratch_dir=tmp_path) as service:
        if cgroups and service.sandbox.memory_cgroups is None:
            pytest.skip("this host lets the verifier create no memory cgroups")
        assert ("per-run cgroups" if cgroups else "peak RSS") in service.health()
        spec = upload_problem(service, problem_id="reserve", tests=[("1 2\n", "3\n")])
        tasks = [
            CodeTask(problem=spec, language=lang, code=code)
            for progs in (RESERVERS, TOUCHERS)
            for lang, code in sorted(progs.items())
        ]
        verdicts = service.verify(tasks)
    reserved, held = verdicts[: len(RESERVERS)], verdicts[len(RESERVERS) :]
    assert [v.kind for v in reserved] == [VerdictKind.ACCEPTED] * len(RESERVERS), reserved
    assert [v.kind for v in held] == [VerdictKind.MEMORY_LIMIT] * len(TOUCHERS), held
