#!/usr/bin/env bash
# Makes a Debian bookworm base image without a registry: debootstrap into a folder, then
# `docker import`. Prints the image name. Skips the work when the image already exists.
#   deploy/build-base.sh [IMAGE]        (default rookworld/debian:bookworm)
# Needs root (or sudo) for debootstrap; installs debootstrap from Debian when missing.
set -euo pipefail
image="${1:-rookworld/debian:bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

if docker image inspect "$image" >/dev/null 2>&1; then
  echo "$image"
  exit 0
fi
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
if ! command -v debootstrap >/dev/null 2>&1; then
  { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq debootstrap >/dev/null; } >&2
fi
root="$(mktemp -d)"
trap '$SUDO rm -rf "$root"' EXIT
# minbase: apt, dpkg, coreutils, passwd: what debian:bookworm-slim holds, near enough.
$SUDO debootstrap --variant=minbase bookworm "$root" "$mirror" >&2
# What the slim image trims: package lists and caches.
$SUDO rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb
$SUDO tar -C "$root" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["bash"]' - "$image" >&2
echo "$image"
