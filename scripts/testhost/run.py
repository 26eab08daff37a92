#!/usr/bin/env python3
"""Run tests from this checkout on the test host: Debian 13 with systemd 257 as PID 1, pure cgroup v2.

    python3 scripts/testhost/run.py [options] [-- pytest args]
    (default pytest args: -v -n CPUS --dist loadgroup tests/testhost tests/test_aio_spawn.py
    tests/test_seal_attacks.py)

Builds the image when its recipe changed (scripts/testhost/image.py; cached under
/var/cache/cgturn-testhost), copies the checkout (with the built C extension, which git ignores) to a
scratch directory shared with the guest over 9p,
boots the guest's own kernel with QEMU (`snapshot=on`: every run starts from the pristine image),
lets scripts/testhost/guest.sh run pytest there with CGTURN_TESTHOST=1, and brings back the pytest
log, junit XML, the guest's journal and pytest's exit status, which becomes this script's.
KVM is tried first where /dev/kvm opens, under a short time limit; software emulation (TCG) otherwise.
The whole guest runs under a hard deadline (--timeout), so a hang never outlives it.
Exit status: pytest's inside the guest; 1 when the image cannot be built or the guest reports nothing.
"""
from __future__ import annotations

import argparse
import collections
import os
import select
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
import zipfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import image  # noqa: E402  (this directory's module, not a package)

CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB_STARTED = b"cgturn-testhost: job started"
# The C extension as `pip install -e .` or `setup.py build_ext --inplace` leaves it in the checkout.
EXTENSION = "cgturn/_spawn.abi3.so"
EXTENSION_SOURCE = "cgturn/_spawn.c"
# The testhost tests, the asyncio spawn's on the guest's newer Python (3.13): it builds on asyncio's
# subprocess transport, whose internals change between Python versions; and the seal's red team on
# every chain (the extension's sandbox, clone3 then bubblewrap, the shim) against v2 limits.
DEFAULT_TESTS = ["tests/testhost", "tests/test_aio_spawn.py", "tests/test_seal_attacks.py"]


def default_pytest_args(cpus: int) -> list[str]:
    """The default run: DEFAULT_TESTS, verbose, in one pytest-xdist worker per guest vCPU.

    Under TCG one worker left the second vCPU idle for much of the run (interpreter starts, waits on
    systemd and podman). `--dist loadgroup` keeps each `xdist_group` on one worker: the tests that
    share guest-wide state (tests/testhost/hostlib.py) run one after another, the rest on either.
    """
    workers = ["-n", str(cpus), "--dist", "loadgroup"] if cpus > 1 else []
    return ["-v", *workers, *DEFAULT_TESTS]
# A working KVM guest reaches the job in seconds; a broken one (e.g. a paravirtual /dev/kvm on which
# QEMU aborts on an MSR or the guest hits emulation failures) must not cost more than this.
KVM_BOOT_LIMIT = 25.0
KVM_RUN_LIMIT = 300.0
# Seconds from QEMU's start to the guest's job, of the last boot that got there (report_costs).
BOOT_SECONDS: float | None = None
# A guest kernel that dies under TCG (an emulator fault, see main) gets one more boot.
TCG_ATTEMPTS = 2
KERNEL_ARGS = ("root=/dev/vda rw console=ttyS0 panic=-1 quiet loglevel=3 systemd.show_status=false "
               "rd.udev.log_level=3 udev.log_level=3 mitigations=off")


def log(msg: str) -> None:
    print(f"testhost: {msg}", file=sys.stderr, flush=True)


def checkout_files(src: str) -> list[str]:
    """Files of the checkout as git sees them (tracked + untracked, not ignored); all files without git."""
    try:
        out = subprocess.run(["git", "-C", src, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             check=True, capture_output=True).stdout
        return [p for p in out.decode().split("\0") if p and os.path.isfile(os.path.join(src, p))]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for d, dirs, names in os.walk(src):
            dirs[:] = [x for x in dirs if x not in (".git", "__pycache__")]
            files += [os.path.relpath(os.path.join(d, n), src) for n in names]
        return files


def built_extension(src: str) -> str | None:
    """The checkout's built C extension (relative path), which git ignores, or None when it is not built.

    Only the stable-ABI build: it is built for CPython 3.11's limited API (setup.py) and against glibc
    2.9's symbols, so it loads in the guest's Python 3.13 and glibc 2.41; a version-tagged build would not.
    """
    if not os.path.isfile(os.path.join(src, EXTENSION)):
        return None
    source = os.path.join(src, EXTENSION_SOURCE)
    if os.path.isfile(source) and os.path.getmtime(source) > os.path.getmtime(os.path.join(src, EXTENSION)):
        log(f"{EXTENSION} is older than {EXTENSION_SOURCE}: the guest runs the old build "
            "(python3 setup.py build_ext --inplace)")
    return EXTENSION


def make_share(pytest_args: list[str], bench: bool, extension: bool = True) -> str:
    """A scratch copy of the checkout plus the job: the guest's root may write anywhere in it.

    Args:
        pytest_args: what pytest gets in the guest ([]: no pytest).
        bench: also run the systemd-run comparison.
        extension: also copy the built C extension, which git ignores: the guest has no compiler, and
            without it every spawn there takes the shim or posix_spawn, every sealed one bubblewrap.

    Returns:
        The directory, shared with the guest over 9p.
    """
    share = tempfile.mkdtemp(prefix="cgturn-testhost-share-")
    os.chmod(share, 0o755)  # the guest's unprivileged test user reads the checkout too
    files = checkout_files(CHECKOUT)
    built = built_extension(CHECKOUT) if extension else None
    if built is not None:
        files.append(built)
        log(f"copying the built {built} into the guest's checkout")
    else:
        log(f"no built {EXTENSION} in the guest's checkout" + ("" if extension else " (--no-extension)")
            + ": the guest spawns without clone3 and seals with bubblewrap (its clone3 cases skip)")
    for rel in files:
        dst = os.path.join(share, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(os.path.join(CHECKOUT, rel), dst)
    job = os.path.join(share, ".testhost")
    os.makedirs(os.path.join(job, "out"))
    if pytest_args:
        with open(os.path.join(job, "pytest-args.sh"), "w") as f:
            f.write("set -- " + " ".join(shlex.quote(a) for a in pytest_args) + "\n")
    if bench:
        open(os.path.join(job, "bench"), "w").close()
    return share


def add_bench_report(share: str, benchexec: str) -> None:
    """Ask the guest to run scripts/bench_report.py (cgturn run --report against benchexec's runexec),
    with benchexec from `benchexec`, a wheel (`pip download --no-deps benchexec==3.35`) or a directory
    holding the `benchexec` package: the guest has no registry to install it from. Its runexec needs no
    other package (PyYAML is benchexec's, not runexec's); the console script pip would make is written
    beside it."""
    lib = os.path.join(share, ".testhost", "benchexec")
    if os.path.isdir(benchexec):
        shutil.copytree(os.path.join(benchexec, "benchexec"), os.path.join(lib, "benchexec"))
    else:
        with zipfile.ZipFile(benchexec) as wheel:
            wheel.extractall(lib)
    with open(os.path.join(lib, "runexec"), "w") as f:
        f.write("#!/usr/bin/python3\nfrom benchexec.runexecutor import main\nmain()\n")
    os.chmod(os.path.join(lib, "runexec"), 0o755)
    open(os.path.join(share, ".testhost", "bench-report"), "w").close()


def qemu_argv(img: image.Image, share: str, accel: str, memory_mb: int, cpus: int) -> list[str]:
    cpu = "host" if accel == "kvm" else "max"
    accel_opt = "kvm" if accel == "kvm" else "tcg,thread=multi"
    return [
        "qemu-system-x86_64", "-accel", accel_opt, "-cpu", cpu, "-m", str(memory_mb), "-smp", str(cpus),
        "-nodefaults", "-display", "none", "-serial", "stdio", "-no-reboot",
        "-kernel", img.kernel, "-initrd", img.initrd, "-append", KERNEL_ARGS,
        # snapshot=on: writes go to a temporary overlay, the cached image stays pristine.
        "-drive", f"file={img.disk},format=raw,if=virtio,snapshot=on",
        "-virtfs", f"local,path={share},mount_tag=share,security_model=none,id=share",
    ]


def boot(argv: list[str], console, deadline: float, boot_limit: float | None) -> tuple[str, int | None]:
    """Run QEMU, echoing the guest console, until it exits or a limit passes (then kill it).

    Returns (what happened, QEMU's exit code): "exited", "no-boot" (boot_limit passed before the job
    started) or "timeout".
    """
    global BOOT_SECONDS
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen_job = False
    buf = b""
    try:
        while True:
            now = time.monotonic()
            limit = deadline if seen_job or boot_limit is None else min(deadline, started + boot_limit)
            if now >= limit:
                return ("timeout" if seen_job or boot_limit is None else "no-boot"), None
            ready, _, _ = select.select([proc.stdout], [], [], min(1.0, limit - now))
            if not ready:
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                return "exited", proc.wait()
            console.write(chunk)
            console.flush()
            sys.stdout.buffer.write(chunk.replace(b"\r", b""))
            sys.stdout.flush()
            buf = (buf + chunk)[-4096:]
            if not seen_job and JOB_STARTED in buf:
                seen_job = True
                BOOT_SECONDS = time.monotonic() - started
                log(f"guest job started {BOOT_SECONDS:.0f} s after boot")
    finally:
        if proc.poll() is None:
            proc.kill()  # the QEMU process this function started, by its own handle
        proc.wait()


def test_file_costs(junit_path: str) -> list[tuple[str, float]]:
    """Seconds per test file from pytest's junit XML (fixtures included), the costliest first; [] when
    there is none (the guest reported nothing) or it cannot be read."""
    try:
        tree = ElementTree.parse(junit_path)
    except (OSError, ElementTree.ParseError):
        return []
    costs: collections.Counter[str] = collections.Counter()
    for case in tree.iter("testcase"):
        path = case.get("classname", "?").replace(".", "/") + ".py"
        costs[path] += float(case.get("time") or 0.0)
    return costs.most_common()


def report_costs(results: str, boot_seconds: float | None, console_path: str) -> None:
    """Log what each part of the guest's run cost: the boot, each test file, the bench (the stage's
    budget is spent under software emulation, so its parts are printed on every run)."""
    parts = [f"boot {boot_seconds:.0f} s"] if boot_seconds is not None else []
    with open(console_path, "rb") as f:
        text = f.read().decode("utf-8", "replace")
    parts += [line.split("cost: ", 1)[1].strip() for line in text.splitlines() if "cgturn-testhost: cost: " in line]
    if parts:
        log("cost: " + ", ".join(parts))
    for path, seconds in test_file_costs(os.path.join(results, "junit.xml")):
        log(f"cost: {seconds:6.1f} s  {path}")


def _guest_kernel_died(console_path: str, since: int) -> bool:
    """Whether the console written from byte `since` on shows the guest kernel's own death."""
    with open(console_path, "rb") as f:
        f.seek(since)
        text = f.read()
    return b"Kernel panic - not syncing" in text


def kvm_usable() -> bool:
    try:
        fd = os.open("/dev/kvm", os.O_RDWR)
    except OSError:
        return False
    os.close(fd)
    return True


def reset_out(share: str) -> None:
    out = os.path.join(share, ".testhost", "out")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accel", choices=("auto", "kvm", "tcg"), default=os.environ.get("CGTURN_TESTHOST_ACCEL", "auto"))
    p.add_argument("--timeout", type=float, default=900.0, help="hard limit for one boot of the guest, seconds (default 900; a guest kernel that dies under TCG is booted once more)")
    p.add_argument("--results", help="directory for pytest.log, junit.xml, journal.txt, console.log "
                   "(default: a new directory under $TMPDIR)")
    p.add_argument("--bench", action="store_true", help="also run scripts/testhost/bench_systemd_run.py")
    p.add_argument("--bench-report", metavar="WHEEL", help="also run scripts/bench_report.py (cgturn run "
                   "--report against benchexec's runexec) with benchexec from WHEEL, a wheel file or a directory "
                   "holding the benchexec package (a measurement: CI does not run it)")
    p.add_argument("--no-tests", action="store_true", help="run no pytest (e.g. only --bench)")
    p.add_argument("--no-extension", action="store_true",
                   help="leave the built C extension out of the guest's checkout (as git sees it)")
    p.add_argument("--build-only", action="store_true", help="build the image if needed, boot nothing")
    p.add_argument("--rebuild", action="store_true", help="build the image even if a cached one exists")
    p.add_argument("--memory", type=int, default=2048, help="guest memory, MiB")
    p.add_argument("--cpus", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("pytest_args", nargs="*", help="after --: pytest arguments (default: -v -n CPUS --dist "
                   "loadgroup tests/testhost tests/test_aio_spawn.py tests/test_seal_attacks.py)")
    args = p.parse_args(argv)

    t0 = time.monotonic()
    try:
        img = image.build(force=args.rebuild)
    except image.BuildError as e:
        log(f"cannot build the image: {e}")
        return 1
    log(f"image {img.directory} ready after {time.monotonic() - t0:.0f} s")
    if args.build_only:
        return 0

    pytest_args = [] if args.no_tests else (args.pytest_args or default_pytest_args(args.cpus))
    if args.no_tests and not (args.bench or args.bench_report):
        log("nothing to run (--no-tests without --bench or --bench-report)")
        return 2
    if args.bench_report and not os.path.exists(args.bench_report):
        log(f"--bench-report: no such wheel or directory: {args.bench_report}")
        return 2
    share = make_share(pytest_args, args.bench, extension=not args.no_extension)
    if args.bench_report:
        add_bench_report(share, args.bench_report)
    results = args.results or tempfile.mkdtemp(prefix="cgturn-testhost-results-")
    os.makedirs(results, exist_ok=True)
    try:
        with open(os.path.join(results, "console.log"), "wb") as console:
            deadline = time.monotonic() + args.timeout
            outcome, accel = None, None
            if args.accel in ("auto", "kvm") and kvm_usable():
                log("trying KVM")
                outcome, code = boot(qemu_argv(img, share, "kvm", args.memory, args.cpus), console,
                                     min(deadline, time.monotonic() + KVM_RUN_LIMIT), KVM_BOOT_LIMIT)
                accel = "kvm"
                if not os.path.exists(os.path.join(share, ".testhost", "out", "status")):
                    log(f"KVM did not run the job ({outcome}, qemu exit {code}): software emulation (TCG)")
                    if args.accel == "kvm":
                        return 1
                    outcome = None
                    reset_out(share)
            if outcome is None:
                accel = "tcg"
                for attempt in range(1, TCG_ATTEMPTS + 1):
                    log("booting under TCG" + (f" (attempt {attempt})" if attempt > 1 else ""))
                    console_start = console.tell()
                    if attempt > 1:  # --timeout is per boot: a retry gets the whole of it again
                        deadline = time.monotonic() + args.timeout
                    outcome, code = boot(qemu_argv(img, share, "tcg", args.memory, args.cpus), console,
                                         deadline, None)
                    if outcome != "exited" or os.path.exists(os.path.join(share, ".testhost", "out", "status")):
                        break
                    if not _guest_kernel_died(console.name, console_start):
                        break
                    # Multi-threaded TCG now and then runs a stale translation of kernel text the guest
                    # just patched (a static key's int3: "Oops: int3" in a kernel function, then a
                    # panic): the emulator's fault, not the tests'. Boot once more.
                    log("the guest kernel died under TCG (console: Oops/panic): booting again")
                    reset_out(share)
        out = os.path.join(share, ".testhost", "out")
        for name in os.listdir(out):
            shutil.copy2(os.path.join(out, name), os.path.join(results, name))
        status_file = os.path.join(out, "status")
        elapsed = time.monotonic() - t0
        report_costs(results, BOOT_SECONDS, os.path.join(results, "console.log"))
        if outcome == "timeout":
            log(f"guest killed after --timeout {args.timeout:.0f} s ({accel}); results in {results}")
            return 1
        if not os.path.exists(status_file):
            log(f"the guest reported no status ({accel}, qemu exit {code}); console in {results}/console.log")
            return 1
        with open(status_file) as f:
            status = int(f.read().strip() or 1)
        log(f"pytest in the guest exited {status} ({accel}, {elapsed:.0f} s in all); results in {results}")
        return status
    finally:
        shutil.rmtree(share, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
