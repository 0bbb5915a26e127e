#!/usr/bin/env bash
# Installs what building and testing Tessera needs on Debian 12 (no-op when already present).
set -euo pipefail
packages=(cmake g++ ninja-build libgtest-dev libcli11-dev libdlpack-dev python3 python3-pip)
missing=()
for package in "${packages[@]}"; do
  dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
done
if ((${#missing[@]})); then
  echo "tessera: installing ${missing[*]}" >&2
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi
