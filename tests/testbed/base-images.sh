#!/usr/bin/env bash
# Build the Debian systemd base images the testbed boxes boot from, once: debootstrap + docker import
# (docs/testbed.md: bookworm ~50 s, trixie ~59 s). Rebuilt only when missing.
# Usage: base-images.sh [bookworm] [trixie]
source "$(dirname "$0")/lib.sh"

build_one() {
  local suite=$1 image="teamserve-testbed/debian:$1"
  if image_exists "$image"; then log "$image cached"; return 0; fi
  command -v debootstrap >/dev/null || { apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; }
  local root; root=$(mktemp -d "$TESTBED_CACHE/rootfs-$suite.XXXX")
  log "debootstrap $suite (about a minute)"
  debootstrap --variant=minbase \
    --include=systemd,systemd-sysv,python3,sudo,iproute2,ca-certificates,gnupg,curl \
    "$suite" "$root" http://deb.debian.org/debian >"$TESTBED_CACHE/debootstrap-$suite.log" 2>&1
  # Tidy the image: no apt lists, and systemd units that cannot work in a container masked.
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin
  for unit in systemd-udevd.service systemd-udev-trigger.service getty.target console-getty.service \
              systemd-firstboot.service systemd-remount-fs.service sys-kernel-debug.mount; do
    ln -sf /dev/null "$root/etc/systemd/system/$unit"
  done
  echo "teamserve-box" >"$root/etc/hostname"
  tar -C "$root" -c . | docker import -c 'CMD ["/lib/systemd/systemd"]' -c 'ENV container=docker' \
    - "$image" >/dev/null
  rm -rf "$root"
  log "$image built"
}

suites=("$@"); [[ ${#suites[@]} -gt 0 ]] || suites=(bookworm)
for s in "${suites[@]}"; do with_lock "base-$s" build_one "$s"; done
