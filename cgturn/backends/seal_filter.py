"""The seccomp filter of a sealed spawn: what capabilities do not cover, as a classic BPF program
that bubblewrap installs (`bwrap --seccomp FD`) right before it execs the target.

Hand-assembled, on purpose: libseccomp's Python binding (python3-seccomp) ships only for Debian's
system Python, not for the interpreters cgturn also runs under, and the program is some fifty
instructions that never change at run time. It answers, for x86_64 (seccomp(2), Docker's default
profile for the choices):

- `clone3` → ENOSYS. seccomp cannot read clone3's flags (they sit in a struct in memory), so a
  filter that must refuse CLONE_NEWUSER refuses the call; libc then falls back to `clone`.
- `unshare` and `clone` with CLONE_NEWUSER → EPERM: a user namespace is the one namespace an
  unprivileged process may make, and inside one it may mount cgroup hierarchies rooted at its own
  cgroups and lift its limits (issue 21, attack 2). `user.max_user_namespaces` is never touched.
- kernel keyrings (`add_key`, `request_key`, `keyctl`: not namespaced), `open_by_handle_at` (reads
  any file on a mount it can name; CAP_DAC_READ_SEARCH is dropped too), module loading, kexec and
  `reboot` (their capabilities are dropped too; refused here whatever the kernel's configuration),
  the mount API and `setns` (CAP_SYS_ADMIN is dropped too) → EPERM.
- `ioctl(TIOCSTI)` and `ioctl(TIOCLINUX)` → EPERM: they push input into a terminal the target
  shares with the caller (`dev.tty.legacy_tiocsti` is 1 on many kernels; bubblewrap's answer is
  `--new-session`, which would take the target out of the caller's job control).
- any other architecture (a 32-bit `int 0x80`, x32 numbers) → ENOSYS: the numbers above are x86_64's.
"""
from __future__ import annotations

import errno
import os
import struct

from ..errors import IsolationUnavailable

# linux/filter.h, linux/seccomp.h, linux/audit.h
_LD_W_ABS = 0x20          # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15             # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35             # BPF_JMP | BPF_JGE | BPF_K
_JSET_K = 0x45            # BPF_JMP | BPF_JSET | BPF_K
_RET_K = 0x06             # BPF_RET | BPF_K
_ALLOW = 0x7FFF0000       # SECCOMP_RET_ALLOW
_ERRNO = 0x00050000       # SECCOMP_RET_ERRNO | errno
_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_BIT = 0x40000000
# struct seccomp_data: nr at 0, arch at 4, args[i] at 16 + 8 i (the low 32 bits first: little endian)
_NR, _ARCH, _ARG0, _ARG1 = 0, 4, 16, 24

CLONE_NEWUSER = 0x10000000
TIOCSTI, TIOCLINUX = 0x5412, 0x541C

# x86_64 numbers (arch/x86/entry/syscalls/syscall_64.tbl)
CLONE, UNSHARE, CLONE3, IOCTL = 56, 272, 435, 16
REFUSED = {
    "add_key": 248, "request_key": 249, "keyctl": 250,
    "open_by_handle_at": 304,
    "init_module": 175, "finit_module": 313, "delete_module": 176,
    "kexec_load": 246, "kexec_file_load": 320, "reboot": 169,
    "mount": 165, "umount2": 166, "pivot_root": 155, "setns": 308,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "mount_setattr": 442,
}


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def _search(special: list[tuple[int, str]], name: str = "n") -> list:
    """A binary search over the sorted (syscall number, label) pairs, each leaf ending in "allow".

    A search, not a chain of comparisons: the kernel runs the program for every number when the
    filter is installed (seccomp_cache_prepare, Linux 5.11+, to learn which calls it may allow
    without running it), so its cost follows the longest path: with the 25 numbers in a chain, 99 us
    per install here; in a search, a third of that. The accepted numbers stay what the chain gave.
    """
    if len(special) <= 3:
        return [*((_JEQ_K, label, 0, nr) for nr, label in special), (_RET_K, 0, 0, _ALLOW)]
    middle = len(special) // 2
    right = f"{name}r"
    return [(_JGE_K, right, 0, special[middle][0]), *_search(special[:middle], f"{name}l"),
            right, *_search(special[middle:], right)]


def program() -> bytes:
    """The filter as `struct sock_filter` records, as `bwrap --seccomp` reads them.

    Raises:
        IsolationUnavailable: not an x86_64 machine (the only syscall table written here).
    """
    machine = os.uname().machine  # what platform.machine() reads, without importing platform
    if machine != "x86_64":
        raise IsolationUnavailable(f"the seal's syscall filter is written for x86_64, not {machine}")
    # (code, jump-if-true, jump-if-false, k): a jump is 0 (the next instruction) or a label's name;
    # a bare string is a label for the instruction after it.
    special = sorted([(CLONE3, "enosys"), (UNSHARE, "flags"), (CLONE, "flags"), (IOCTL, "ioctl"),
                      *((nr, "eperm") for nr in REFUSED.values())])
    body: list[tuple[int, int | str, int | str, int] | str] = [
        (_LD_W_ABS, 0, 0, _ARCH),
        (_JEQ_K, 0, "enosys", _AUDIT_ARCH_X86_64),
        (_LD_W_ABS, 0, 0, _NR),
        (_JGE_K, "enosys", 0, _X32_BIT),
        *_search(special),
        "flags",
        (_LD_W_ABS, 0, 0, _ARG0),
        (_JSET_K, "eperm", 0, CLONE_NEWUSER),
        (_RET_K, 0, 0, _ALLOW),
        "ioctl",
        (_LD_W_ABS, 0, 0, _ARG1),
        (_JEQ_K, "eperm", 0, TIOCSTI),
        (_JEQ_K, "eperm", 0, TIOCLINUX),
        (_RET_K, 0, 0, _ALLOW),
        "enosys",
        (_RET_K, 0, 0, _ERRNO | errno.ENOSYS),
        "eperm",
        (_RET_K, 0, 0, _ERRNO | errno.EPERM),
    ]
    labels: dict[str, int] = {}
    insns: list[tuple[int, int | str, int | str, int]] = []
    for entry in body:
        if isinstance(entry, str):
            labels[entry] = len(insns)
        else:
            insns.append(entry)

    def offset(index: int, target: int | str) -> int:
        # A jump counts from the next instruction (BPF), in 8 bits: the program is far shorter.
        return labels[target] - index - 1 if isinstance(target, str) else target

    out = [_insn(code, offset(i, jt), offset(i, jf), k) for i, (code, jt, jf, k) in enumerate(insns)]
    return b"".join(out)
