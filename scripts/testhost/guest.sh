#!/bin/sh
# Runs inside the test host (as root, from the oneshot unit baked into the image) with the scratch
# copy of the checkout mounted at /share. Reads the job the host wrote in /share/.testhost/, runs it,
# leaves the results in /share/.testhost/out/ and returns 0: the unit then powers the VM off.
# Lives in the checkout, not the image, so changing the job never rebuilds the image.
set -u
job=/share/.testhost
out=$job/out
mkdir -p "$out"
echo "cgturn-testhost: job started"

# cgturn from the share, as if installed: the CLI on PATH (contrib/cgturn.service calls
# /usr/local/bin/cgturn) and the pytest11 entry point that `pip install` would register.
export PYTHONPATH=/share
cat > /usr/local/bin/cgturn <<'WRAPPER'
#!/bin/sh
PYTHONPATH=/share exec python3 -m cgturn "$@"
WRAPPER
chmod 0755 /usr/local/bin/cgturn
site=$(python3 -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
mkdir -p "$site/cgturn-0.0.0.dist-info"
printf 'Metadata-Version: 2.1\nName: cgturn\nVersion: 0.0.0\n' > "$site/cgturn-0.0.0.dist-info/METADATA"
printf '[pytest11]\ncgturn = cgturn.pytest_plugin\n' > "$site/cgturn-0.0.0.dist-info/entry_points.txt"
printf '/share\n' > "$site/cgturn-share.pth"

{
    echo "kernel: $(uname -r)"
    echo "systemd: $(systemctl --version | head -1)"
    echo "glibc: $(getconf GNU_LIBC_VERSION)"
    echo "python: $(python3 -V 2>&1)"
    echo "cgroup2 controllers: $(cat /sys/fs/cgroup/cgroup.controllers)"
    echo "root subtree_control: $(cat /sys/fs/cgroup/cgroup.subtree_control)"
    echo "cgroup2 mount: $(grep cgroup2 /proc/self/mounts)"
} | tee "$out/host-info.txt"

export CGTURN_TESTHOST=1 HOME=/root
cd /share
# How much of pytest's time the guest's CPUs had nothing to run (docs/testhost.md, "Two workers"):
# what more parallelism in the guest could still use. cpu_ticks: clock ticks of all CPUs so far,
# "total idle" (idle + iowait).
cpu_ticks() { awk '/^cpu /{print $2+$3+$4+$5+$6+$7+$8+$9, $5+$6}' /proc/stat; }
idle_since() {  # idle_since TOTAL IDLE: percent of the CPU time since then that was idle
    cpu_ticks | awk -v t="$1" -v i="$2" '{d = $1 - t; printf "%d", (d > 0 ? 100 * ($2 - i) / d : 0)}'
}
status=0
if [ -f "$job/pytest-args.sh" ]; then
    # pytest-args.sh sets the positional parameters ("set -- ..."), quoted by the host.
    . "$job/pytest-args.sh"
    echo "cgturn-testhost: python3 -m pytest $*"
    started=$(date +%s)
    ticks=$(cpu_ticks)
    # POSIX sh has no pipefail: the status goes to a file, where tee cannot hide it.
    { python3 -m pytest --junitxml="$out/junit.xml" "$@"; echo $? > "$out/.pytest-status"; } 2>&1 \
        | tee "$out/pytest.log"
    status=$(cat "$out/.pytest-status" 2>/dev/null || echo 1)
    echo "cgturn-testhost: cost: pytest $(( $(date +%s) - started )) s (guest CPUs idle $(idle_since $ticks) %)"
fi
echo "$status" > "$out/status"
if [ -f "$job/bench" ]; then
    echo "cgturn-testhost: scripts/testhost/bench_systemd_run.py"
    started=$(date +%s)
    python3 scripts/testhost/bench_systemd_run.py 2>&1 | tee "$out/bench.txt"
    echo "cgturn-testhost: cost: bench $(( $(date +%s) - started )) s"
fi
if [ -f "$job/bench-report" ]; then
    # run.py --bench-report: benchexec from the share; runexec gets a delegated systemd scope, cgturn's
    # managed root sits below the cgroup2 root (this service's own cgroup delegates no controller).
    echo "cgturn-testhost: scripts/bench_report.py"
    started=$(date +%s)
    PYTHONPATH="/share:$job/benchexec" python3 scripts/bench_report.py --runexec "$job/benchexec/runexec" \
        --parent /sys/fs/cgroup --rounds 5 2>&1 | tee "$out/bench-report.txt"
    echo "cgturn-testhost: cost: bench-report $(( $(date +%s) - started )) s"
fi
journalctl -b --no-pager -o short-monotonic > "$out/journal.txt" 2>&1
sync
echo "cgturn-testhost: job finished, pytest status $status"
exit 0
