#!/usr/bin/env bash
# Installs what building and testing Tessera needs on Debian 12 (no-op when already present).
set -euo pipefail
# Optional groups as arguments: `fuzz` adds clang + compiler-rt for libFuzzer (tools/fuzz.sh).
packages=(cmake g++ ninja-build libgtest-dev libcli11-dev libdlpack-dev python3 python3-pip)
for group in "$@"; do
  case "$group" in
    fuzz) packages+=(clang-14 libclang-rt-14-dev) ;;
    *) echo "install-deps.sh: unknown group '$group'" >&2; exit 2 ;;
  esac
done
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
