"""The seal's syscall filter as a program: every syscall number, and the argument cases it reads,
answered as the spec in seal_filter's docstring says. A small classic-BPF interpreter runs it here
(a parser-level check of the hand-assembled program, beside the real kernel's in test_seal_attacks.py,
which installs it and makes the calls)."""
from __future__ import annotations

import errno
import struct

import pytest

from cgturn.backends import seal_filter as sf

ALLOW, ENOSYS, EPERM = 0x7FFF0000, 0x00050000 | errno.ENOSYS, 0x00050000 | errno.EPERM


def run(program: bytes, nr: int, arch: int = 0xC000003E, args: tuple[int, ...] = (0,) * 6) -> int:
    """The action the program returns for one struct seccomp_data, as the kernel's interpreter would."""
    return trace(program, nr, arch, args)[0]


def trace(program: bytes, nr: int, arch: int = 0xC000003E, args: tuple[int, ...] = (0,) * 6) -> tuple[int, int]:
    """The action, and how many instructions ran before it."""
    data = struct.pack("<iI Q", nr, arch, 0) + b"".join(struct.pack("<Q", a) for a in args)
    insns = [struct.unpack("=HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]
    pc, acc = 0, 0
    for steps in range(len(insns)):  # forward jumps only: a program ends within its length
        code, jt, jf, k = insns[pc]
        if code == 0x20:
            acc = struct.unpack_from("<I", data, k)[0]
            pc += 1
        elif code == 0x06:
            return k, steps
        else:
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += 1 + (jt if taken else jf)
    raise AssertionError("the program ran off its end")


@pytest.fixture(scope="module")
def program() -> bytes:
    return sf.program()


def test_every_syscall_number_gets_what_the_spec_says(program):
    for nr in range(0, 600):
        want = ENOSYS if nr == sf.CLONE3 else EPERM if nr in sf.REFUSED.values() else ALLOW
        assert run(program, nr) == want, nr


def test_user_namespaces_are_refused_only_by_their_flag(program):
    for nr in (sf.CLONE, sf.UNSHARE):
        assert run(program, nr, args=(sf.CLONE_NEWUSER | 0x11,) + (0,) * 5) == EPERM
        assert run(program, nr, args=(0x20000 | 0x11,) + (0,) * 5) == ALLOW   # CLONE_NEWNS and a signal


def test_terminal_input_injection_is_refused_and_other_ioctls_pass(program):
    assert run(program, sf.IOCTL, args=(0, sf.TIOCSTI, 0, 0, 0, 0)) == EPERM
    assert run(program, sf.IOCTL, args=(0, sf.TIOCLINUX, 0, 0, 0, 0)) == EPERM
    assert run(program, sf.IOCTL, args=(0, 0x5401, 0, 0, 0, 0)) == ALLOW     # TCGETS


def test_other_architectures_and_x32_numbers_get_enosys(program):
    assert run(program, 0, arch=0x40000003) == ENOSYS                         # i386
    assert run(program, 0x40000000 | 1) == ENOSYS


def test_no_path_is_longer_than_the_search_needs(program):
    """The install cost follows the longest path (seccomp_cache_prepare runs every number): a chain of
    all 25 numbers would be over 28 instructions; the search keeps every path short."""
    assert max(trace(program, nr)[1] for nr in range(0, 600)) <= 14
