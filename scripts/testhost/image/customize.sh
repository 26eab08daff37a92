#!/bin/sh
# mmdebstrap customize hook: $1 is the root directory of the image being built.
# Keeps the guest's boot lean under software emulation: only what the test job needs starts.
set -eu
root=$1
here=$(dirname "$0")

echo cgturn-testhost > "$root/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 cgturn-testhost\n' > "$root/etc/hosts"
# Root comes from the kernel command line (root=/dev/vda rw); the share is the scratch checkout.
cat > "$root/etc/fstab" <<'FSTAB'
share /share 9p trans=virtio,version=9p2000.L,msize=524288,access=any,nofail 0 0
FSTAB
mkdir -p "$root/share"

install -m 0644 "$here/cgturn-testhost.service" "$root/etc/systemd/system/cgturn-testhost.service"
chroot "$root" systemctl enable cgturn-testhost.service
chroot "$root" systemctl set-default multi-user.target

# Nothing reads a login prompt, syncs clocks or runs periodic maintenance in a VM that lives minutes.
for unit in serial-getty@ttyS0.service getty@tty1.service getty.target console-getty.service \
        apt-daily.timer apt-daily-upgrade.timer dpkg-db-backup.timer e2scrub_all.timer \
        e2scrub_reap.service fstrim.timer systemd-tmpfiles-clean.timer logrotate.timer man-db.timer \
        systemd-timesyncd.service systemd-networkd-wait-online.service networking.service \
        systemd-pstore.service systemd-firstboot.service systemd-machine-id-commit.service \
        keyboard-setup.service console-setup.service systemd-binfmt.service \
        proc-sys-fs-binfmt_misc.automount sys-kernel-config.mount systemd-journal-catalog-update.service \
        ldconfig.service systemd-update-done.service; do
    chroot "$root" systemctl mask "$unit" >/dev/null 2>&1
done
# Nothing to update after the image was built: ConditionNeedsUpdate= units stay quiet at boot.
touch "$root/etc/.updated" "$root/var/.updated"
# A fixed machine id: no first-boot setup, and `systemd-machine-id-setup` stays quiet.
chroot "$root" systemd-machine-id-setup >/dev/null 2>&1 || true

# The unprivileged user of the delegation tests (a system service with User= and a user manager).
chroot "$root" useradd --create-home --uid 1000 --shell /bin/sh cgtest

# Rootless podman as cgtest: subordinate ids for its user namespace (newuidmap from uidmap).
grep -q '^cgtest:' "$root/etc/subuid" 2>/dev/null || echo 'cgtest:100000:65536' >> "$root/etc/subuid"
grep -q '^cgtest:' "$root/etc/subgid" 2>/dev/null || echo 'cgtest:100000:65536' >> "$root/etc/subgid"
# podman builds its pod infra image from catatonit at this path (podman-kube-play(1): no registry
# is reachable from the guest, so the image is made locally).
if [ ! -e "$root/usr/libexec/podman/catatonit" ] && [ -x "$root/usr/bin/catatonit" ]; then
    mkdir -p "$root/usr/libexec/podman"
    ln -s /usr/bin/catatonit "$root/usr/libexec/podman/catatonit"
fi
# Never pull: the guest has no network, and every image the tests use is localhost/.
mkdir -p "$root/etc/containers/containers.conf.d"
printf '[engine]\npull_policy = "never"\n' > "$root/etc/containers/containers.conf.d/cgturn-test.conf"
