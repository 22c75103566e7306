#!/usr/bin/env bash
# Build the SIGNED stand-in NVIDIA apt repositories and serve them to the testbed (docs/contracts.md):
#   container teamserve-apt on network teamserve-lan at 10.231.0.2, HTTP port 80, python3 -m http.server
#   from teamserve-testbed/debian:bookworm, serving $TESTBED_CACHE/apt read-only.
# URL paths are shaped like NVIDIA's:
#   http://10.231.0.2/compute/cuda/repos/debian12/x86_64/   (and debian13)  key: .../x86_64/testbed.pub
#   http://10.231.0.2/libnvidia-container/stable/deb/amd64/                  key: /libnvidia-container/gpgkey
# The GPG key is a TEST key made here on first use and kept in $TESTBED_CACHE/gnupg (never in git);
# its fingerprint is written to $TESTBED_CACHE/apt.env as TESTBED_APT_KEY_FINGERPRINT.
# The repo is rebuilt only when tests/testbed/nvidia/ changes (hash kept in $TESTBED_CACHE/apt.sources.sha256).
# Usage: apt-repo.sh [build|serve|stop]   (default: build + serve)
source "$(dirname "$0")/lib.sh"

APT_DIR="$TESTBED_CACHE/apt"
GNUPGHOME_DIR="$TESTBED_CACHE/gnupg"
CONTAINER=teamserve-apt
IMAGE=teamserve-testbed/debian:bookworm

ensure_key() {
  mkdir -p "$GNUPGHOME_DIR"; chmod 700 "$GNUPGHOME_DIR"
  local fpr
  fpr=$(GNUPGHOME="$GNUPGHOME_DIR" gpg --batch --with-colons --list-secret-keys 2>/dev/null | awk -F: '$1=="fpr"{print $10; exit}')
  if [[ -z "$fpr" ]]; then
    log "generating the testbed's apt signing key (TEST ONLY)"
    GNUPGHOME="$GNUPGHOME_DIR" gpg --batch --passphrase '' --quick-gen-key \
      'teamserve testbed apt repository (TEST KEY, not NVIDIA) <testbed@teamserve.invalid>' ed25519 sign never 2>/dev/null
    fpr=$(GNUPGHOME="$GNUPGHOME_DIR" gpg --batch --with-colons --list-secret-keys | awk -F: '$1=="fpr"{print $10; exit}')
  fi
  printf 'TESTBED_APT_KEY_FINGERPRINT=%s\nTESTBED_APT_URL=http://10.231.0.2\n' "$fpr" >"$TESTBED_CACHE/apt.env"
  echo "$fpr"
}

sources_hash() {
  (cd "$TESTBED_DIR" && find nvidia -type f ! -name '*.pyc' -print0 | sort -z | xargs -0 sha256sum; sha256sum apt-repo.sh) | sha256sum | cut -d' ' -f1
}

build() {
  local fpr want have=""
  fpr=$(ensure_key)
  want="$(sources_hash) $fpr"
  [[ -f "$TESTBED_CACHE/apt.sources.sha256" ]] && have=$(cat "$TESTBED_CACHE/apt.sources.sha256")
  if [[ -d "$APT_DIR" && "$have" == "$want" ]]; then log "apt repo cached ($APT_DIR)"; return 0; fi
  log "building the stand-in apt repo into $APT_DIR"
  python3 "$TESTBED_DIR/nvidia/build_repo.py" "$APT_DIR" "$GNUPGHOME_DIR" "$fpr"
  echo "$want" >"$TESTBED_CACHE/apt.sources.sha256"
  log "apt repo built (key $fpr)"
}

serve() {
  ensure_networks
  image_exists "$IMAGE" || bash "$TESTBED_DIR/base-images.sh" bookworm
  # A rebuild replaces $APT_DIR as a whole (new inode); a running container's bind mount would keep
  # serving the old, deleted tree, so it is recreated unless it sees the current directory.
  if [[ "$(docker inspect -f '{{.State.Running}}' "$CONTAINER" 2>/dev/null)" == "true" ]] \
     && [[ "$(docker exec "$CONTAINER" stat -c %i /srv/apt 2>/dev/null)" == "$(stat -c %i "$APT_DIR")" ]]; then
    log "$CONTAINER already serving"
  else
    docker rm -f "$CONTAINER" >/dev/null 2>&1 || true
    docker run -d --name "$CONTAINER" --network teamserve-lan --ip 10.231.0.2 \
      -v "$APT_DIR:/srv/apt:ro" -w /srv/apt --restart unless-stopped \
      "$IMAGE" python3 -m http.server 80 --bind 0.0.0.0 --directory /srv/apt >/dev/null
  fi
  # Bounded wait (20 x 0.5 s) for the index to answer from inside the container itself.
  for _ in $(seq 1 20); do
    if docker exec "$CONTAINER" python3 -c 'import urllib.request as u; u.urlopen("http://127.0.0.1/libnvidia-container/gpgkey", timeout=2)' 2>/dev/null; then
      log "$CONTAINER serving http://10.231.0.2/"; return 0
    fi
    sleep 0.5
  done
  log "$CONTAINER did not answer"; return 1
}

case "${1:-all}" in
  build) with_lock apt-repo build ;;
  serve) serve ;;
  stop) docker rm -f "$CONTAINER" >/dev/null 2>&1 || true ;;
  all) with_lock apt-repo build; with_lock apt-serve serve ;;
  *) echo "usage: $0 [build|serve|stop]" >&2; exit 2 ;;
esac
