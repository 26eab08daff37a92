"""Build the test host's disk image from Debian packages, cached by a hash of its recipe.

The image is Debian 13 (systemd 257 as PID 1, pure cgroup v2, kernel 6.12, glibc 2.41) made by
mmdebstrap into a directory and turned into an ext4 image with `mkfs.ext4 -d` (no loop mount). Its
recipe is this file's package list and suite plus the files in image/; the cache directory is named
after their hash, so a change to the recipe builds a new image and nothing else does.

The mirror is read from this machine's apt configuration (sources.list, *.list, deb822 *.sources):
the repository names no mirror host. `CGTURN_TESTHOST_MIRROR` overrides it.
"""
from __future__ import annotations

import dataclasses
import fcntl
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import time

SUITE = "trixie"
# What the guest needs: systemd as PID 1 with logind and a user bus (the delegation tests), a kernel
# and an initrd to boot it directly, and cgturn's Python dependencies as Debian packages (a venv in
# the guest takes ~50 s to create under emulation).
PACKAGES = [
    "systemd", "systemd-sysv", "udev", "dbus", "dbus-user-session", "libpam-systemd", "kmod",
    "procps", "iproute2", "util-linux", "passwd", "initramfs-tools", "zstd", "linux-image-amd64",
    "python3", "python3-psutil", "python3-prometheus-client", "python3-pytest", "python3-hypothesis",
    "python3-pytest-xdist", "python3-pyroute2", "bubblewrap", "python3-jeepney",
]
# Container runtimes (tests/testhost/test_testhost_containers.py): podman with crun needs no daemon;
# catatonit is what podman builds its pod infra ("pause") image from, locally, for `kube play`;
# uidmap (newuidmap) and passt are what rootless podman needs.
PACKAGES += ["podman", "crun", "catatonit", "uidmap", "passt"]
# The containers' root filesystem, made at image-build time (no registry is reachable from the guest):
# a directory the tests run with `podman run --rootfs` (read-only: no image import, which cost 249 s
# of a run under emulation) and `podman import` as localhost/cgturn-test where an image is needed
# (`kube play`). What cgturn runs on inside it, as Debian packages, as in the guest.
CONTAINER_PACKAGES = ["python3", "python3-psutil", "python3-pytest", "python3-pyroute2", "procps"]
CONTAINER_ROOTFS = "/var/lib/cgturn-test/rootfs"
# The same rootfs as an image in the guest's root podman storage, imported at build time (under
# emulation the import cost 249 s of a run; here it is seconds, cached with the image): `kube play`
# needs an image, and a cluster's Pod names one.
CONTAINER_IMAGE = "localhost/cgturn-test:latest"
IMAGE_SIZE = "3G"
HERE = os.path.dirname(os.path.abspath(__file__))
RECIPE_DIR = os.path.join(HERE, "image")
CACHE_ROOT = os.environ.get("CGTURN_TESTHOST_CACHE", "/var/cache/cgturn-testhost")
# Debian's own archive suites; a line for one of them (not -security, -updates, -backports) names the
# machine's Debian mirror.
_DEBIAN_SUITES = {"oldstable", "stable", "testing", "unstable", "sid", "bullseye", "bookworm", "trixie",
                  "forky", "duke"}


class BuildError(Exception):
    """The image could not be built (one line, with what failed)."""


@dataclasses.dataclass(frozen=True)
class Image:
    directory: str

    @property
    def kernel(self) -> str:
        return os.path.join(self.directory, "vmlinuz")

    @property
    def initrd(self) -> str:
        return os.path.join(self.directory, "initrd.img")

    @property
    def disk(self) -> str:
        return os.path.join(self.directory, "root.img")


def parse_one_line_sources(text: str) -> list[tuple[str, str, list[str]]]:
    """`deb [opts] URI SUITE COMPONENT...` lines -> (uri, suite, components); deb-src and comments skipped."""
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line.startswith("deb "):
            continue
        words = line[4:].strip()
        if words.startswith("["):
            words = words.split("]", 1)[1] if "]" in words else ""
        parts = words.split()
        if len(parts) >= 2:
            out.append((parts[0], parts[1], parts[2:]))
    return out


def parse_deb822_sources(text: str) -> list[tuple[str, str, list[str]]]:
    """deb822 stanzas (apt's .sources, sources.list(5)) -> (uri, suite, components) for `Types: deb`."""
    out = []
    for stanza in text.split("\n\n"):
        fields: dict[str, str] = {}
        key = None
        for raw in stanza.splitlines():
            if raw.lstrip().startswith("#") or not raw.strip():
                continue
            if raw[0] in " \t" and key:
                fields[key] += " " + raw.strip()
                continue
            key, _, value = raw.partition(":")
            key = key.strip().lower()
            fields[key] = value.strip()
        if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes").lower() == "no":
            continue
        for uri in fields.get("uris", "").split():
            for suite in fields.get("suites", "").split():
                out.append((uri, suite, fields.get("components", "").split()))
    return out


def debian_mirror(apt_dir: str = "/etc/apt") -> str:
    """The Debian archive URI this machine's apt uses (first match), from its sources files."""
    override = os.environ.get("CGTURN_TESTHOST_MIRROR")
    if override:
        return override
    entries = []
    main_list = os.path.join(apt_dir, "sources.list")
    for path in [main_list, *sorted(glob.glob(os.path.join(apt_dir, "sources.list.d", "*")))]:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        if path == main_list or path.endswith(".list"):
            entries += parse_one_line_sources(text)
        elif path.endswith(".sources"):
            entries += parse_deb822_sources(text)
    for uri, suite, components in entries:
        if suite in _DEBIAN_SUITES and "main" in components:
            return uri.rstrip("/")
    raise BuildError(f"no Debian archive with 'main' found in {apt_dir}/sources.list* "
                     "(set CGTURN_TESTHOST_MIRROR to a Debian mirror URI)")


def recipe_hash() -> str:
    """Hash of everything that decides the image's content (not the mirror: any mirror serves the same)."""
    h = hashlib.sha256()
    h.update(f"{SUITE}\n{' '.join(PACKAGES)}\n{IMAGE_SIZE}\n{' '.join(CONTAINER_PACKAGES)} {CONTAINER_ROOTFS} {CONTAINER_IMAGE}\n".encode())
    for name in sorted(os.listdir(RECIPE_DIR)):
        with open(os.path.join(RECIPE_DIR, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()[:16]


def cached_image() -> Image | None:
    img = Image(os.path.join(CACHE_ROOT, recipe_hash()))
    return img if all(os.path.exists(p) for p in (img.kernel, img.initrd, img.disk)) else None


def _run(argv: list[str], log) -> None:
    log.write(f"$ {' '.join(argv)}\n")
    log.flush()
    proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise BuildError(f"{argv[0]} exited with {proc.returncode} (log: {log.name})")


def missing_tools() -> list[str]:
    return [t for t in ("mmdebstrap", "mkfs.ext4", "qemu-system-x86_64") if shutil.which(t) is None]


def build(force: bool = False, out=sys.stderr) -> Image:
    """Return the cached image for the current recipe, building it first when there is none.

    Concurrent builders serialise on a lock file; the image appears by an atomic rename, so a
    half-built image is never used.
    """
    missing = missing_tools()
    if missing:
        raise BuildError(f"missing tools: {' '.join(missing)} "
                         "(apt-get install qemu-system-x86 qemu-utils mmdebstrap e2fsprogs)")
    os.makedirs(CACHE_ROOT, exist_ok=True)
    digest = recipe_hash()
    final = os.path.join(CACHE_ROOT, digest)
    with open(os.path.join(CACHE_ROOT, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and cached_image() is not None:
            os.utime(final)  # marks it used, for _prune
            return Image(final)
        work = f"{final}.tmp-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        log_path = os.path.join(CACHE_ROOT, f"{digest}.build.log")
        started = time.monotonic()
        mirror = debian_mirror()
        print(f"testhost: building image {digest} from {SUITE} at {mirror} (log: {log_path})", file=out)
        try:
            with open(log_path, "w") as log:
                _build_into(work, mirror, log)
            if os.path.exists(final):
                shutil.rmtree(final)
            os.rename(work, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(f"testhost: image built in {time.monotonic() - started:.0f} s", file=out)
        _prune(keep=digest)
        return Image(final)


def _prune(keep: str, unused_days: float = 7.0) -> None:
    """Remove images of other recipes not used for `unused_days` (each is ~400 MB); caller holds the lock."""
    cutoff = time.time() - unused_days * 86400
    for entry in os.scandir(CACHE_ROOT):
        if entry.name == keep or not entry.is_dir() or len(entry.name.split(".")[0]) != 16:
            continue
        if entry.stat().st_mtime < cutoff or ".tmp-" in entry.name:
            shutil.rmtree(entry.path, ignore_errors=True)


# Lean: no documentation or translations in a VM (or a container) nobody logs into.
_LEAN = ["--dpkgopt=path-exclude=/usr/share/man/*", "--dpkgopt=path-exclude=/usr/share/doc/*",
         "--dpkgopt=path-exclude=/usr/share/locale/*", "--dpkgopt=path-exclude=/usr/share/info/*",
         "--aptopt=Acquire::Retries \"3\""]


def _build_into(work: str, mirror: str, log) -> None:
    rootfs = os.path.join(work, "rootfs")
    hook = os.path.join(RECIPE_DIR, "initramfs-hook")
    customize = os.path.join(RECIPE_DIR, "customize.sh")
    _run([
        "mmdebstrap", "--variant=apt", "--mode=root", "--components=main",
        "--include=" + ",".join(PACKAGES),
        *_LEAN,
        # Before the kernel is installed, so its initrd is generated once, small.
        "--essential-hook=mkdir -p \"$1/etc/initramfs-tools/conf.d\" \"$1/etc/initramfs-tools/hooks\"",
        "--essential-hook=printf 'MODULES=list\\nCOMPRESS=zstd\\n' > \"$1/etc/initramfs-tools/conf.d/cgturn\"",
        f"--essential-hook=install -m 0755 {hook} \"$1/etc/initramfs-tools/hooks/cgturn-virtio\"",
        f"--customize-hook=sh {customize} \"$1\"",
        SUITE, rootfs, f"deb {mirror} {SUITE} main",
    ], log)
    started = time.monotonic()
    container_root = os.path.join(rootfs, CONTAINER_ROOTFS.lstrip("/"))
    os.makedirs(os.path.dirname(container_root), exist_ok=True)
    _run([
        "mmdebstrap", "--variant=essential", "--mode=root", "--components=main",
        "--include=" + ",".join(CONTAINER_PACKAGES),
        *_LEAN,
        SUITE, container_root, f"deb {mirror} {SUITE} main",
    ], log)
    log.write(f"container rootfs: {time.monotonic() - started:.0f} s\n")
    started = time.monotonic()
    _import_container_image(rootfs, log)
    log.write(f"container image import: {time.monotonic() - started:.0f} s\n")
    boot = os.path.join(rootfs, "boot")
    kernels = sorted(glob.glob(os.path.join(boot, "vmlinuz-*")))
    initrds = sorted(glob.glob(os.path.join(boot, "initrd.img-*")))
    if not kernels or not initrds:
        raise BuildError(f"no kernel or initrd in {boot} after mmdebstrap (log: {log.name})")
    shutil.copy2(kernels[-1], os.path.join(work, "vmlinuz"))
    shutil.copy2(initrds[-1], os.path.join(work, "initrd.img"))
    disk = os.path.join(work, "root.img")
    _run(["mkfs.ext4", "-q", "-F", "-L", "cgturn-root", "-d", rootfs, disk, IMAGE_SIZE], log)
    shutil.rmtree(rootfs)


def _import_container_image(rootfs: str, log) -> None:
    """`podman import` the containers' rootfs as CONTAINER_IMAGE into the image's own root storage
    (/var/lib/containers/storage), with the image's podman in a chroot.

    In a mount namespace of its own (unshare --mount, private propagation): the mounts the chroot
    needs never reach this machine's and go with the namespace. The root is bind-mounted on itself
    (podman unpacks a layer in a chroot of its own and remounts its `/`, which must be a mount point);
    /sys is a fresh sysfs (no cgroup mounts below it: nothing of this machine's cgroups is in
    reach); /dev/shm (podman's lock file), /run and /tmp are tmpfs, as /run and /tmp are when the guest
    boots, so no run-time state is baked into the image."""
    script = ('set -e; r="$1"; mount --bind "$r" "$r"; mount -t proc proc "$r/proc"; '
              'mount --rbind /dev "$r/dev"; mount -t tmpfs tmpfs "$r/dev/shm"; mount -t sysfs sysfs "$r/sys"; '
              'mount -t tmpfs tmpfs "$r/run"; mount -t tmpfs tmpfs "$r/tmp"; '
              f'tar -C "$r{CONTAINER_ROOTFS}" -cf - . | '
              f'chroot "$r" podman --events-backend=none import - {CONTAINER_IMAGE}; '
              'chroot "$r" podman --events-backend=none images')
    env = dict(os.environ, PODMAN_IGNORE_CGROUPSV1_WARNING="1")  # /sys without cgroups reads as v1
    log.write(f"$ unshare --mount ... podman import - {CONTAINER_IMAGE}\n")
    log.flush()
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "-", rootfs],
                          stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    if proc.returncode != 0:
        raise BuildError(f"podman import of the containers' rootfs exited with {proc.returncode} (log: {log.name})")


if __name__ == "__main__":
    try:
        img = build(force="--force" in sys.argv)
    except BuildError as e:
        print(f"testhost: {e}", file=sys.stderr)
        sys.exit(1)
    print(img.directory)
