// Supervisor that runs inside every bubblewrap sandbox (DESIGN.md §9).
//
// bwrap starts it as root with only CAP_SETUID, CAP_SETGID and CAP_KILL, in fresh pid/net/ipc/uts
// namespaces. It forks the untrusted program, which sets its rlimits, drops to the sandbox uid (all capabilities
// go with it) and execs. The supervisor stays root, so the program cannot signal, trace or read it.
// It enforces the wall-clock limit, kills every process left in the namespace when the program
// ends, and reports one status line on the status fd, which the program never holds:
//   exited=<0|1> code=<n> signal=<n> cpu_ms=<n> wall_ms=<n> maxrss_kb=<n> timed_out=<0|1> exec_errno=<n>
//
// usage: launcher --status-fd FD --uid U --gid G --wall-ms N --cpu-s N --as BYTES --fsize BYTES --nofile N
//                 --nproc N --stack BYTES [--stdin PATH] [--cwd DIR] -- PROGRAM ARGS...
// A limit of 0 means "leave unlimited".

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

namespace {

struct Options {
  long status_fd = -1, uid = -1, gid = -1, wall_ms = 0, cpu_s = 0, as = 0, fsize = 0, nofile = 0, nproc = 0, stack = 0;
  const char* stdin_path = nullptr;
  const char* cwd = "/";
  char** argv = nullptr;
};

[[noreturn]] void die(const char* what) {
  fprintf(stderr, "launcher: %s: %s\n", what, strerror(errno));
  _exit(120);
}

long number(const char* s) {
  char* end = nullptr;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || !end || *end || v < 0) {
    fprintf(stderr, "launcher: bad number %s\n", s);
    _exit(120);
  }
  return v;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    if (!strcmp(a, "--")) {
      o.argv = argv + i + 1;
      break;
    }
    if (i + 1 >= argc) break;
    const char* v = argv[++i];
    if (!strcmp(a, "--status-fd")) o.status_fd = number(v);
    else if (!strcmp(a, "--uid")) o.uid = number(v);
    else if (!strcmp(a, "--gid")) o.gid = number(v);
    else if (!strcmp(a, "--wall-ms")) o.wall_ms = number(v);
    else if (!strcmp(a, "--cpu-s")) o.cpu_s = number(v);
    else if (!strcmp(a, "--as")) o.as = number(v);
    else if (!strcmp(a, "--fsize")) o.fsize = number(v);
    else if (!strcmp(a, "--nofile")) o.nofile = number(v);
    else if (!strcmp(a, "--nproc")) o.nproc = number(v);
    else if (!strcmp(a, "--stack")) o.stack = strcmp(v, "unlimited") ? number(v) : -1;
    else if (!strcmp(a, "--stdin")) o.stdin_path = v;
    else if (!strcmp(a, "--cwd")) o.cwd = v;
    else {
      fprintf(stderr, "launcher: unknown option %s\n", a);
      _exit(120);
    }
  }
  if (!o.argv || !o.argv[0] || o.uid <= 0 || o.gid <= 0 || o.status_fd < 3) {
    fprintf(stderr, "launcher: need --status-fd, --uid, --gid (non-root) and -- PROGRAM\n");
    _exit(120);
  }
  return o;
}

void limit(int resource, long value, long hard_extra = 0) {
  if (value <= 0) return;
  struct rlimit r;
  r.rlim_cur = (rlim_t)value;
  r.rlim_max = (rlim_t)(value + hard_extra);
  if (setrlimit(resource, &r)) die("setrlimit");
}

// Closes every fd >= first except keep: close_range(2) where the kernel has it (5.9+), else a
// loop up to the highest fd the process may have.
void close_from(int first, int keep) {
  auto close_span = [](unsigned lo, unsigned hi) {
    if (lo > hi) return;
#ifdef SYS_close_range
    if (syscall(SYS_close_range, lo, hi, 0) == 0) return;
#endif
    struct rlimit r;
    long top = getrlimit(RLIMIT_NOFILE, &r) == 0 && r.rlim_max != RLIM_INFINITY ? (long)r.rlim_max : 1 << 20;
    for (long fd = lo; fd <= (long)hi && fd < top; ++fd) close((int)fd);
  };
  close_span((unsigned)first, (unsigned)keep - 1);
  close_span((unsigned)keep + 1, ~0U);
}

long elapsed_ms(const struct timespec& start) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return (now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000;
}

// Runs in the forked child: never returns. Exec failures go to err_fd as an errno.
[[noreturn]] void become_program(const Options& o, int err_fd) {
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  setpgid(0, 0);
  if (chdir(o.cwd)) die("chdir");
  umask(022);
  limit(RLIMIT_CPU, o.cpu_s, 1);  // SIGXCPU at the soft limit, SIGKILL one second later
  limit(RLIMIT_AS, o.as);
  limit(RLIMIT_FSIZE, o.fsize);
  limit(RLIMIT_NOFILE, o.nofile);
  limit(RLIMIT_NPROC, o.nproc);
  if (o.stack == -1) {
    // Unlimited: the main thread's stack grows up to RLIMIT_AS, and glibc gives new threads its
    // default 8 MiB stack (with a finite limit every thread would reserve that much address space).
    struct rlimit inf = {RLIM_INFINITY, RLIM_INFINITY};
    if (setrlimit(RLIMIT_STACK, &inf)) die("setrlimit stack");
  } else {
    limit(RLIMIT_STACK, o.stack);
  }
  struct rlimit zero = {0, 0};
  setrlimit(RLIMIT_CORE, &zero);
  setrlimit(RLIMIT_MEMLOCK, &zero);
  setrlimit(RLIMIT_MSGQUEUE, &zero);
  if (o.stdin_path) {
    // Opened while still root (without CAP_DAC_OVERRIDE: only what root owns or anyone may read),
    // so a root-only 0400 file can be the program's stdin without the program being able to
    // open it by name: the unit-test harness gets its trusted test code this way.
    int fd = open(o.stdin_path, O_RDONLY | O_NOFOLLOW);
    if (fd < 0 || dup2(fd, 0) < 0) {
      int e = errno;
      (void)!write(err_fd, &e, sizeof e);
      _exit(120);
    }
    if (fd != 0) close(fd);
  }
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)) die("no_new_privs");
  if (setgroups(0, nullptr)) die("setgroups");
  if (setresgid(o.gid, o.gid, o.gid)) die("setresgid");
  if (setresuid(o.uid, o.uid, o.uid)) die("setresuid");
  if (setuid(0) == 0 || getuid() != (uid_t)o.uid) {  // paranoia: privileges must be gone for good
    fprintf(stderr, "launcher: could not drop root\n");
    _exit(120);
  }
  prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
  prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);  // cleared by setresuid, so set after it
  execvp(o.argv[0], o.argv);
  int e = errno;
  (void)!write(err_fd, &e, sizeof e);
  _exit(127);
}

}  // namespace

int main(int argc, char** argv) {
  // kill(-1, SIGKILL) below must only ever reach a fresh pid namespace: run anywhere else (as
  // root on the host) it would kill every process on the machine. Inside bwrap --unshare-pid the
  // launcher is one of the first pids; on the host no process started after boot is (the kernel
  // hands out pids below 300 only at boot).
  if (getpid() > 64) {
    fprintf(stderr, "launcher: refusing to run outside its own pid namespace (pid %d)\n", (int)getpid());
    return 120;
  }
  Options o = parse(argc, argv);
  int status_fd = (int)o.status_fd;
  if (fcntl(status_fd, F_GETFD) < 0) {
    fprintf(stderr, "launcher: status fd %d is not open\n", status_fd);
    return 120;
  }
  fcntl(status_fd, F_SETFD, FD_CLOEXEC);
  prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);  // keeps /proc/<pid>/fd of the supervisor out of reach
  int err_pipe[2];
  if (pipe2(err_pipe, O_CLOEXEC)) die("pipe");

  sigset_t chld;
  sigemptyset(&chld);
  sigaddset(&chld, SIGCHLD);
  sigprocmask(SIG_BLOCK, &chld, nullptr);

  struct timespec start;
  clock_gettime(CLOCK_MONOTONIC, &start);
  pid_t child = fork();
  if (child < 0) die("fork");
  if (child == 0) {
    close(err_pipe[0]);
    // Every inherited descriptor but stdio and the exec-error pipe stays behind, however high.
    close_from(3, err_pipe[1]);
    become_program(o, err_pipe[1]);
  }
  close(err_pipe[1]);

  int status = 0, timed_out = 0;
  struct rusage ru;
  memset(&ru, 0, sizeof ru);
  for (;;) {
    pid_t r = wait4(child, &status, WNOHANG, &ru);
    if (r == child) break;
    if (r < 0 && errno != EINTR) die("wait4");
    long left = o.wall_ms > 0 ? o.wall_ms - elapsed_ms(start) : 1000;
    if (o.wall_ms > 0 && left <= 0) {
      timed_out = 1;
      kill(-1, SIGKILL);  // everything in this pid namespace except us
      if (wait4(child, &status, 0, &ru) < 0) die("wait4");
      break;
    }
    struct timespec ts = {left / 1000, (left % 1000) * 1000000};
    sigtimedwait(&chld, nullptr, &ts);
  }
  long wall = elapsed_ms(start);
  kill(-1, SIGKILL);  // orphans, daemons and zombies' parents go with the program

  int exec_errno = 0;
  if (read(err_pipe[0], &exec_errno, sizeof exec_errno) != (ssize_t)sizeof exec_errno) exec_errno = 0;
  long cpu_ms = (ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1000 +
                (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1000;
  dprintf(status_fd, "exited=%d code=%d signal=%d cpu_ms=%ld wall_ms=%ld maxrss_kb=%ld timed_out=%d exec_errno=%d\n",
          WIFEXITED(status) ? 1 : 0, WIFEXITED(status) ? WEXITSTATUS(status) : -1,
          WIFSIGNALED(status) ? WTERMSIG(status) : 0, cpu_ms, wall, ru.ru_maxrss, timed_out, exec_errno);
  return 0;
}
