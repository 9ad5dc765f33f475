"""A seccomp-BPF filter for sandboxed programs, handed to bubblewrap (``--seccomp FD``).

Namespaces and a non-root uid already confine the program; the filter removes kernel attack
surface it never needs (tracing, mounting, new namespaces, keyrings, BPF, io_uring, module and
clock syscalls). Denied calls fail with EPERM; foreign ABIs (x32, 32-bit) kill the process, so the
syscall numbers below cannot be bypassed. Only x86_64 is covered; elsewhere no filter is built.
"""

from __future__ import annotations

import errno
import platform
import struct

_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_SYSCALL_BIT = 0x40000000
_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000
_RET_ALLOW = 0x7FFF0000
_LD_ABS_W, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_OFF_NR, _OFF_ARCH, _OFF_ARG0 = 0, 4, 16

_CLONE_NEW_NAMESPACES = 0x7E020000  # CLONE_NEW{NS,CGROUP,UTS,IPC,USER,PID,NET}
_CLONE, _CLONE3 = 56, 435

# x86_64 numbers of the denied syscalls.
DENIED_X86_64 = {
    "ptrace": 101,
    "syslog": 103,
    "vhangup": 153,
    "pivot_root": 155,
    "adjtimex": 159,
    "chroot": 161,
    "acct": 163,
    "settimeofday": 164,
    "mount": 165,
    "umount2": 166,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "iopl": 172,
    "ioperm": 173,
    "init_module": 175,
    "delete_module": 176,
    "quotactl": 179,
    "lookup_dcookie": 212,
    "clock_settime": 227,
    "kexec_load": 246,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "unshare": 272,
    "perf_event_open": 298,
    "fanotify_init": 300,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
    "clock_adjtime": 305,
    "setns": 308,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "finit_module": 313,
    "kexec_file_load": 320,
    "bpf": 321,
    "userfaultfd": 323,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "mount_setattr": 442,
}


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def supported() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def build_filter() -> bytes:
    """The filter program as bytes (an array of ``struct sock_filter``), for x86_64."""
    eperm = _RET_ERRNO | errno.EPERM
    prog = [
        _insn(_LD_ABS_W, _OFF_ARCH),
        _insn(_JEQ, _AUDIT_ARCH_X86_64, jt=1),
        _insn(_RET, _RET_KILL_PROCESS),
        _insn(_LD_ABS_W, _OFF_NR),
        _insn(_JGE, _X32_SYSCALL_BIT, jf=1),
        _insn(_RET, _RET_KILL_PROCESS),
        # clone3 hides its flags in memory; ENOSYS makes libc fall back to clone.
        _insn(_JEQ, _CLONE3, jf=1),
        _insn(_RET, _RET_ERRNO | errno.ENOSYS),
        _insn(_JEQ, _CLONE, jf=4),
        _insn(_LD_ABS_W, _OFF_ARG0),
        _insn(_JSET, _CLONE_NEW_NAMESPACES, jf=1),
        _insn(_RET, eperm),
        _insn(_RET, _RET_ALLOW),
    ]
    for nr in sorted(DENIED_X86_64.values()):
        prog += [_insn(_JEQ, nr, jf=1), _insn(_RET, eperm)]
    prog.append(_insn(_RET, _RET_ALLOW))
    return b"".join(prog)
