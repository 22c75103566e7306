#!/usr/bin/env bash
# prometheus, promtool, amtool and mtail for the unit tests: the exact Debian packages the monitoring role installs
# (versions read from roles/monitoring/defaults/main.yml), unpacked into DIR. Nothing is installed on this
# machine and no service starts. Usage: monitoring-tools.sh DIR
set -euo pipefail
dir=$1
repo=$(cd "$(dirname "$0")/../.." && pwd)
defaults="$repo/roles/monitoring/defaults/main.yml"
pin() { sed -n "s/^$1: \"\\(.*\\)\"$/\\1/p" "$defaults"; }
packages=("prometheus=$(pin monitoring_prometheus_version)"
          "prometheus-alertmanager=$(pin monitoring_alertmanager_version)"
          "mtail=$(pin monitoring_mtail_version)")
rm -rf "$dir.tmp" && mkdir -p "$dir.tmp/debs"
cd "$dir.tmp/debs"
# A fresh machine may have no package lists yet.
apt-get download "${packages[@]}" >/dev/null 2>&1 || { apt-get update -qq && apt-get download "${packages[@]}"; }
for deb in ./*.deb; do dpkg-deb -x "$deb" "$dir.tmp/root"; done
rm -rf "$dir" && mkdir -p "$dir/bin"
for tool in prometheus promtool amtool mtail; do cp "$dir.tmp/root/usr/bin/$tool" "$dir/bin/"; done
rm -rf "$dir.tmp"
printf '%s\n' "${packages[@]}" > "$dir/versions"
"$dir/bin/promtool" --version | head -1
