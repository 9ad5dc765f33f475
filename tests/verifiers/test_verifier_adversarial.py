"""Hostile programs: each gets the right verdict and leaves the host unharmed.

Every program reads three lines on stdin (a host canary directory, the project directory, the port
of a host TCP listener) and prints "safe" when all its attacks failed; the jury's answer is "safe".
After each one the test checks the host: no process runs as a sandbox uid, the canary directory
and the project directory gained nothing, the listener saw no connection, and a fake secret in
the service's environment never reached the program.
"""

from __future__ import annotations

import contextlib
import os
import socket
import textwrap
import threading
import uuid
from pathlib import Path

import pytest

from rlax_tpu.types import VerdictKind as K
from rlax_tpu.verifiers.api import CodeTask
from rlax_tpu.verifiers.problems import upload_problem

REPO = Path(__file__).resolve().parents[2]
SECRET_NAME = "RLAX_FAKE_SECRET"
SECRET_VALUE = "s3cr3t-" + uuid.uuid4().hex

PY_READ_ARGS = "import sys\ncanary, project, port = sys.stdin.read().split()\nport = int(port)\n"

CASES = {
    # --- process and CPU abuse -----------------------------------------------------------------
    "py_fork_bomb": (
        "python",
        "import os\nwhile True:\n    os.fork()\n",
        {K.RUNTIME_ERROR, K.TIME_LIMIT},
    ),
    "cpp_fork_bomb": (
        "cpp",
        "#include <unistd.h>\nint main() { while (true) fork(); }\n",
        {K.TIME_LIMIT, K.RUNTIME_ERROR},
    ),
    "py_infinite_loop": ("python", "while True:\n    pass\n", {K.TIME_LIMIT}),
    "java_infinite_loop": (
        "java",
        "public class Main { public static void main(String[] a) { long x = 0; while (true) x++; } }\n",
        {K.TIME_LIMIT},
    ),
    "py_sleep_past_deadline": ("python", "import time\ntime.sleep(1000)\n", {K.TIME_LIMIT}),
    "cpp_busy_threads": (
        "cpp",
        textwrap.dedent("""\
            #include <pthread.h>
            void* spin(void*) { volatile long x = 0; while (true) ++x; }
            int main() {
              pthread_attr_t attr;  // small stacks: the default is the whole stack rlimit
              pthread_attr_init(&attr);
              pthread_attr_setstacksize(&attr, 1 << 16);
              pthread_t t;
              for (int i = 0; i < 16; ++i) pthread_create(&t, &attr, spin, nullptr);
              spin(nullptr);
            }
        """),
        {K.TIME_LIMIT},
    ),
    # --- memory and disk -----------------------------------------------------------------------
    "py_memory_bomb": (
        "python",
        "a = []\nwhile True:\n    a.append(' ' * 10**7)\n",
        {K.MEMORY_LIMIT},
    ),
    "cpp_memory_bomb": (
        "cpp",
        textwrap.dedent("""\
            #include <cstring>
            #include <vector>
            int main() {
              std::vector<char*> blocks;
              while (true) { char* p = new char[1 << 24]; std::memset(p, 1, 1 << 24); blocks.push_back(p); }
            }
        """),
        {K.MEMORY_LIMIT},
    ),
    "rust_memory_bomb": (
        "rust",
        "fn main() {\n    let mut v: Vec<Vec<u8>> = Vec::new();\n    loop { v.push(vec![1u8; 1 << 24]); }\n}\n",
        {K.MEMORY_LIMIT},
    ),
    # Every child allocates up to the address-space limit: RLIMIT_AS binds each process, so the
    # run's total is bounded only by how few processes it may have.
    "py_fork_and_memory_bomb": (
        "python",
        textwrap.dedent("""\
            import os
            for _ in range(1000):
                try:
                    if os.fork() == 0:
                        break
                except OSError:
                    break
            blocks = []
            while True:
                blocks.append(bytearray(1 << 24))
        """),
        {K.MEMORY_LIMIT, K.RUNTIME_ERROR, K.TIME_LIMIT},
    ),
    "cpp_fork_and_memory_bomb": (
        "cpp",
        textwrap.dedent("""\
            #include <cstring>
            #include <unistd.h>
            int main() {
              for (int i = 0; i < 1000 && fork() > 0; ++i) {}
              while (true) { char* p = new char[1 << 24]; std::memset(p, 1, 1 << 24); }
            }
        """),
        {K.MEMORY_LIMIT, K.RUNTIME_ERROR, K.TIME_LIMIT},
    ),
    "py_disk_fill_many_files": (
        "python",
        textwrap.dedent("""\
            import os
            written = 0
            for d in ("/work", "/tmp"):
                try:
                    for i in range(100000):
                        with open(f"{d}/fill{i}", "wb") as f:
                            f.write(b"x" * (512 << 10))
                        written += 512 << 10
                except OSError:
                    pass
            print("safe" if written <= 2 * (64 << 20) else f"wrote {written}")
        """),
        {K.ACCEPTED},
    ),
    "cpp_disk_fill_one_file": (
        "cpp",
        '#include <cstdio>\nint main() { FILE* f = fopen("/tmp/big", "wb"); static char b[1 << 16];'
        " while (true) fwrite(b, 1, sizeof b, f); }\n",
        {K.OUTPUT_LIMIT},
    ),
    # --- filesystem escapes ------------------------------------------------------------------------
    "py_write_outside_work_dir": (
        "python",
        PY_READ_ARGS
        + textwrap.dedent("""\
            escaped = []
            for path in ("/usr/pwned", "/etc/pwned", "/pwned", "/prog/pwned", "/proc/pwned",
                         "/dev/pwned", "/input", "/prog/main.py", "/proc/sysrq-trigger",
                         canary + "/pwned", project + "/PWNED"):
                try:
                    with open(path, "a") as f:
                        f.write("x")
                    escaped.append(path)
                except OSError:
                    pass
            print("safe" if not escaped else "wrote " + " ".join(escaped))
        """),
        {K.ACCEPTED},
    ),
    "py_read_host_files_and_secrets": (
        "python",
        PY_READ_ARGS
        + textwrap.dedent(f"""\
            import glob, os
            leaks = []
            for path in ["/etc/shadow", "/etc/passwd", "/root/.bashrc", project + "/pyproject.toml",
                         canary + "/canary.txt"] + glob.glob("/proc/*/environ"):
                try:
                    data = open(path, "rb").read()
                    if b"{SECRET_NAME}" in data or b"root:" in data or b"canary" in data \\
                            or b"[project]" in data:
                        leaks.append(path)
                except OSError:
                    pass
            if any("{SECRET_NAME}" in k or "s3cr3t" in v for k, v in os.environ.items()):
                leaks.append("environ")
            print("safe" if not leaks else "leaked " + " ".join(leaks))
        """),
        {K.ACCEPTED},
    ),
    "cpp_read_host_files": (
        "cpp",
        textwrap.dedent("""\
            #include <cstdio>
            #include <iostream>
            #include <string>
            int main() {
              std::string canary, project;
              std::cin >> canary >> project;
              const std::string paths[] = {"/etc/shadow", "/root/.profile", project + "/Makefile",
                                           canary + "/canary.txt", "/proc/1/environ"};
              for (const auto& p : paths) {
                FILE* f = fopen(p.c_str(), "r");
                if (f && fgetc(f) != EOF) { std::cout << "read " << p << "\\n"; return 0; }
              }
              std::cout << "safe\\n";
            }
        """),
        {K.ACCEPTED},
    ),
    # --- network -------------------------------------------------------------------------------
    "py_network_sockets": (
        "python",
        PY_READ_ARGS
        + textwrap.dedent("""\
            import socket
            reached = []
            for host in ("127.0.0.1", "10.0.0.1", "8.8.8.8"):
                try:
                    s = socket.create_connection((host, port if host == "127.0.0.1" else 53), timeout=1)
                    reached.append(host)
                    s.close()
                except OSError:
                    pass
            try:
                socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("8.8.8.8", 53))
                reached.append("udp")
            except OSError:
                pass
            print("safe" if not reached else "reached " + " ".join(reached))
        """),
        {K.ACCEPTED},
    ),
    "rust_network_socket": (
        "rust",
        textwrap.dedent("""\
            use std::io::Read;
            use std::net::TcpStream;
            fn main() {
                let mut s = String::new();
                std::io::stdin().read_to_string(&mut s).unwrap();
                let port: u16 = s.split_whitespace().nth(2).unwrap().parse().unwrap();
                match TcpStream::connect(("127.0.0.1", port)) {
                    Ok(_) => println!("connected"),
                    Err(_) => println!("safe"),
                }
            }
        """),
        {K.ACCEPTED},
    ),
    # --- signals, privileges, kernel surface ---------------------------------------------------------
    "py_kill_the_parent": (
        "python",
        "import os, signal\ntry:\n    os.kill(os.getppid(), signal.SIGKILL)\n    print('killed')\n"
        "except PermissionError:\n    print('safe')\n",
        {K.ACCEPTED},
    ),
    # kill(-1) reaches only the program's own namespace: the supervisor and the host survive.
    "py_kill_everything": (
        "python",
        "import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('safe')\n",
        {K.ACCEPTED},
    ),
    "py_privilege_and_kernel_calls": (
        "python",
        textwrap.dedent("""\
            import ctypes, os
            libc = ctypes.CDLL(None, use_errno=True)
            gained = []
            try:
                os.setuid(0)
                gained.append("setuid")
            except PermissionError:
                pass
            caps = [l for l in open("/proc/self/status") if l.startswith("CapEff")][0].split()[1]
            if int(caps, 16):
                gained.append("caps")
            if libc.unshare(0x10000000) == 0:  # CLONE_NEWUSER
                gained.append("unshare")
            if libc.ptrace(16, 1, 0, 0) == 0:  # PTRACE_ATTACH to pid 1
                gained.append("ptrace")
            if libc.mount(b"none", b"/tmp", b"tmpfs", 0, None) == 0:
                gained.append("mount")
            print("safe" if not gained else "gained " + " ".join(gained))
        """),
        {K.ACCEPTED},
    ),
    # --- output --------------------------------------------------------------------------------
    "py_huge_output": (
        "python",
        "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n",
        {K.OUTPUT_LIMIT},
    ),
    "java_huge_output": (
        "java",
        "public class Main { public static void main(String[] a) {"
        ' String s = "x".repeat(65536); while (true) System.out.print(s); } }\n',
        {K.OUTPUT_LIMIT},
    ),
    # --- leftover processes --------------------------------------------------------------------
    "py_zombies_and_orphans": (
        "python",
        textwrap.dedent("""\
            import os, time
            # A run may hold 8 processes (zombies count): 1 + 3 zombies + 2 x (zombie + orphan).
            for _ in range(3):
                if os.fork() == 0:
                    os._exit(0)  # never reaped: zombies
            for _ in range(2):
                if os.fork() == 0:
                    if os.fork() == 0:
                        os.setsid()
                        time.sleep(1000)  # an orphan that outlives its parent
                    os._exit(0)
            print("safe")
        """),
        {K.ACCEPTED},
    ),
    "cpp_orphan_daemon": (
        "cpp",
        textwrap.dedent("""\
            #include <cstdio>
            #include <unistd.h>
            int main() {
              if (fork() == 0) { setsid(); if (fork() == 0) { while (true) {} } _exit(0); }
              printf("safe\\n");
            }
        """),
        {K.ACCEPTED},
    ),
    # --- compile-time bombs --------------------------------------------------------------------
    "cpp_template_recursion_bomb": (
        "cpp",
        "template <int N> struct Boom { static const int v = Boom<N + 1>::v + Boom<N + 2>::v; };\n"
        "int main() { return Boom<0>::v; }\n",
        {K.COMPILE_ERROR},
    ),
    "cpp_constexpr_bomb": (
        "cpp",
        "constexpr long spin() { long x = 0; for (long i = 0; i < (1L << 40); ++i) x += i; return x; }\n"
        "constexpr long v = spin();\nint main() { return v != 0; }\n",
        {K.COMPILE_ERROR},
    ),
    "cpp_include_dev_zero": ("cpp", '#include "/dev/zero"\nint main() {}\n', {K.COMPILE_ERROR}),
    "cpp_include_host_file": (
        "cpp",
        '#include "/etc/shadow"\nint main() {}\n',
        {K.COMPILE_ERROR},
    ),
}


# Cases whose verdict must not depend on how fast this (shared, loaded) machine starts a JVM or
# writes 128 MB: a generous CPU limit (the wall limit is twice that plus one second).
SLOW_CASES = {
    "java_huge_output": 10.0,
    "py_disk_fill_many_files": 10.0,
    "cpp_disk_fill_one_file": 10.0,
}


@pytest.fixture()
def host_guard(tmp_path, service, monkeypatch, no_sandbox_processes):
    """A canary directory, a host listener and a fake secret; checks the host afterwards."""
    monkeypatch.setenv(SECRET_NAME, SECRET_VALUE)
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "canary.txt").write_text("canary")
    before = sorted(p.name for p in canary.iterdir())
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    connections = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                connections.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    port = listener.getsockname()[1]
    yield f"{canary}\n{REPO}\n{port}\n"
    stop.set()
    thread.join()
    listener.close()
    no_sandbox_processes(service.sandbox.uids)
    assert sorted(p.name for p in canary.iterdir()) == before
    assert (canary / "canary.txt").read_text() == "canary"
    # Other engineers share the working tree: only names a hostile program would write count.
    assert not [n for n in os.listdir(REPO) if "pwned" in n.lower()]
    assert connections == []


def test_suite_is_broad_enough():
    langs = {lang for lang, _, _ in CASES.values()}
    assert len(CASES) >= 20 and {"python", "cpp"} <= langs and len(langs) >= 3


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_program(name, service, host_guard):
    language, code, expected = CASES[name]
    problem = upload_problem(
        service,
        problem_id=f"hostile_{name}",
        tests=[(host_guard, "safe\n")],
        time_limit_s=SLOW_CASES.get(name, 0.5),
        memory_limit_mb=128,
    )
    [verdict] = service.verify([CodeTask(problem=problem, language=language, code=code)])
    assert verdict.kind in expected, (name, verdict)
    assert verdict.detail or verdict.kind is K.ACCEPTED
    assert verdict.is_model_failure == (verdict.kind is not K.ACCEPTED)


def test_tampering_with_checker_and_answer_files(service, host_guard):
    """The program cannot see or change the checker or the jury's answer (round one mounts
    neither), and cannot write its input; the repository's files keep their content."""
    checker = textwrap.dedent("""\
        import sys
        out = open(sys.argv[2]).read().split()
        ans = open(sys.argv[3]).read().split()
        sys.exit(0 if out == ans else 1)
    """)
    problem = upload_problem(
        service,
        problem_id="tamper",
        tests=[("41\n", "42\n")],
        checker_source=checker,
        checker_language="python",
        time_limit_s=0.5,
    )
    hostile = textwrap.dedent("""\
        import glob, os
        found = None
        paths = ["/answer", "/output", "/checker", "/input", "/prog/main.py"]
        for path in paths + glob.glob("/work/**", recursive=True) + glob.glob("/tmp/**", recursive=True):
            try:
                with open(path, "a") as f:
                    f.write("42\\n")
            except OSError:
                pass
            try:
                text = open(path).read()
                if text.strip() == "42":
                    found = text.strip()
            except OSError:
                pass
        link = os.readlink("/proc/self/fd/0")
        print(found or (int(open(link).read()) if link == "/input" else "escaped"))
    """)
    [verdict] = service.verify([CodeTask(problem=problem, language="python", code=hostile)])
    assert verdict.kind is K.WRONG_ANSWER, verdict  # it printed its input (41), not the answer
    assert service.repository.read(problem.tests[0].answer) == b"42\n"
    assert service.repository.read(problem.tests[0].input) == b"41\n"
    assert service.repository.read(problem.checker) == checker.encode()


@pytest.mark.parametrize("language", ["python", "cpp"])
def test_a_run_holds_few_processes(language, service, host_guard):
    """How many processes a run can have at once bounds its memory (each has RLIMIT_AS)."""
    code = {
        "python": textwrap.dedent("""\
            import os, time
            n = 1
            while n < 1000:
                try:
                    if os.fork() == 0:
                        time.sleep(30)
                        os._exit(0)
                except OSError:
                    break
                n += 1
            print("bounded" if n <= 8 else n, flush=True)
            os.kill(-1, 9)
        """),
        "cpp": textwrap.dedent("""\
            #include <csignal>
            #include <cstdio>
            #include <unistd.h>
            int main() {
              int n = 1;
              for (; n < 1000; ++n) {
                pid_t p = fork();
                if (p == 0) { sleep(30); _exit(0); }
                if (p < 0) break;
              }
              if (n <= 8) printf("bounded\\n"); else printf("%d\\n", n);
              fflush(stdout);
              kill(-1, SIGKILL);
            }
        """),
    }[language]
    problem = upload_problem(
        service,
        problem_id=f"few_processes_{language}",
        tests=[(host_guard, "bounded\n")],
        time_limit_s=2.0,
        memory_limit_mb=64,
    )
    [verdict] = service.verify([CodeTask(problem=problem, language=language, code=code)])
    assert verdict.kind is K.ACCEPTED, verdict
