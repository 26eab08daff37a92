"""kernel/sockdiag.py: our own sock_diag dump, checked against pyroute2's decoder on real sockets."""
import ast
import os
import socket
import struct
import subprocess
import sys

import pytest

from cgturn.kernel import discovery, sockdiag

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def key(s):
    return (s.proto, s.address, s.port, s.cgroup_id)


@pytest.fixture
def sockets():
    """One socket of every kind the dump must report, and one of each kind it must not."""
    made = []

    def make(family, kind, address):
        s = socket.socket(family, kind)
        made.append(s)
        s.bind((address, 0))
        if kind == socket.SOCK_STREAM:
            s.listen()
        return s

    listening = [make(socket.AF_INET, socket.SOCK_STREAM, "127.0.0.1"),
                 make(socket.AF_INET6, socket.SOCK_STREAM, "::1"),
                 make(socket.AF_INET, socket.SOCK_DGRAM, "127.0.0.1"),
                 make(socket.AF_INET6, socket.SOCK_DGRAM, "::")]
    connected = make(socket.AF_INET, socket.SOCK_DGRAM, "127.0.0.1")
    connected.connect(("127.0.0.1", 9))
    bound_only = socket.socket()
    made.append(bound_only)
    bound_only.bind(("127.0.0.1", 0))  # bound, never listening: not a server
    yield listening, [connected, bound_only]
    for s in made:
        s.close()


def test_the_dump_agrees_with_pyroute2_on_real_sockets(sockets):
    import pyroute2  # a test dependency: the independent decoder
    listening, others = sockets
    ours = {key(s) for s in sockdiag.listening_sockets()}
    theirs = set()
    with pyroute2.DiagSocket() as diag:
        diag.bind()
        for family in sockdiag.FAMILIES:
            for proto, number, states in sockdiag.PROTOCOLS:
                for reply in diag.get_sock_stats(family=family, protocol=number, states=states):
                    cgroup_id = dict(reply.get("attrs", [])).get("INET_DIAG_CGROUP_ID")
                    theirs.add((proto, str(reply["idiag_src"]), int(reply["idiag_sport"]), cgroup_id))
    assert ours == theirs
    mine = {s.getsockname()[1] for s in listening}
    assert mine <= {port for _, _, port, _ in ours}
    assert not {s.getsockname()[1] for s in others} & {port for _, _, port, _ in ours}
    # as root, each carries the id of the cgroup this process made it in
    own = discovery.discover().own_cgroup
    if os.geteuid() == 0 and own is not None:
        assert {cg for _, _, port, cg in ours if port in mine} == {os.stat(own).st_ino}


def diag_msg(family, port, raw_address, attrs=b""):
    """A struct inet_diag_msg as the kernel lays it out, plus attributes."""
    head = struct.pack("=BBBB", family, 10, 0, 0) + port.to_bytes(2, "big") + b"\0\0"
    return head + raw_address.ljust(16, b"\0") + b"\0" * 16 + b"\0" * 12 + b"\0" * 20 + attrs


def rtattr(kind, payload):
    data = struct.pack("=HH", 4 + len(payload), kind) + payload
    return data + b"\0" * (-len(data) % 4)


def test_parser_reads_addresses_ports_and_the_cgroup_id_among_other_attributes():
    v4 = diag_msg(socket.AF_INET, 8080, socket.inet_pton(socket.AF_INET, "10.1.2.3"),
                  rtattr(5, b"\x01") + rtattr(sockdiag.INET_DIAG_CGROUP_ID, struct.pack("=Q", 1234)))
    assert sockdiag.parse_inet_diag_msg(v4) == ("10.1.2.3", 8080, 1234)
    v6 = diag_msg(socket.AF_INET6, 443, socket.inet_pton(socket.AF_INET6, "fe80::1"))
    assert sockdiag.parse_inet_diag_msg(v6) == ("fe80::1", 443, None)  # a kernel before 5.7: no id


def test_parser_stops_at_a_malformed_attribute():
    bad = diag_msg(socket.AF_INET, 1, b"\x7f\0\0\1", struct.pack("=HH", 2, sockdiag.INET_DIAG_CGROUP_ID))
    assert sockdiag.parse_inet_diag_msg(bad) == ("127.0.0.1", 1, None)



PROBE = """
import socket
from cgturn.kernel import sockdiag
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
print([x.cgroup_id for x in sockdiag.listening_sockets() if x.port == s.getsockname()[1]])
"""


AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
# The system's interpreter, for when this one cannot run as nobody: a pyenv build under /root (0700)
# with a shared libpython fails to load it as nobody (exit 127). The probe needs the standard library
# and this checkout's cgturn.kernel.sockdiag only, which every Python cgturn supports can run.
SYSTEM_PYTHON = "/usr/bin/python3"


def python_nobody_can_run() -> str:
    """This interpreter if nobody can run it, else the system's; skips (saying why) if neither runs."""
    tried = []
    for python in dict.fromkeys([sys.executable, SYSTEM_PYTHON]):
        probe = subprocess.run([*AS_NOBODY, python, "-I", "-c", "import socket, struct"], capture_output=True,
                               text=True, timeout=30)
        if probe.returncode == 0:
            return python
        tried.append(f"{python}: exit {probe.returncode} {probe.stderr.strip()[-120:]}")
    pytest.skip("no interpreter here runs as nobody: " + "; ".join(tried))


@pytest.mark.root
def test_cgroup_ids_come_to_an_unprivileged_caller_too():
    """What makes ports work for a gateway running as a delegated, unprivileged user."""
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to an unprivileged user")
    python = python_nobody_can_run()
    out = subprocess.run([*AS_NOBODY, python, "-I", "-c", f"import sys; sys.path.insert(0, {ROOT!r})\n" + PROBE],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    ids = ast.literal_eval(out.stdout)
    own = discovery.discover().own_cgroup  # the probe runs in ours: it inherited it
    assert ids == [os.stat(own).st_ino]


def test_a_dump_without_cgroup_ids_sends_ports_to_psutil(monkeypatch):
    """Kernels before 5.7 send no ids (not reproducible on this one, hence the stand-in dump)."""
    from cgturn.kernel import observe

    monkeypatch.setattr(sockdiag, "listening_sockets",
                        lambda: [sockdiag.ListeningSocket("tcp", "127.0.0.1", 80, None)])
    with pytest.raises(observe.DiagUnavailable, match="no cgroup ids"):
        observe.listening_sockets()
