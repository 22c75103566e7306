#!/usr/bin/env bash
# Make sure a Docker engine answers on this machine. These machines have the docker CLI but no engine,
# and PID 1 is not systemd, so Debian's docker.io is installed and dockerd started in the background
# (docs/testbed.md, "The test machine, measured"). A running engine is left alone.
source "$(dirname "$0")/lib.sh"

if docker info >/dev/null 2>&1; then
  log "Docker engine already answering"; exit 0
fi
if ! command -v dockerd >/dev/null; then
  log "installing Debian's docker.io and debootstrap"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap gnupg dpkg-dev >/dev/null
fi
log "starting dockerd"
nohup dockerd --storage-driver overlay2 >/var/log/teamserve-dockerd.log 2>&1 &
for _ in $(seq 1 60); do
  docker info >/dev/null 2>&1 && { log "Docker engine up"; exit 0; }
  sleep 1
done
log "dockerd did not answer within 60 s; see /var/log/teamserve-dockerd.log"; exit 1
