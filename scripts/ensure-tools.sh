#!/usr/bin/env bash
# Makes sure the tools the operations tests use are installed: podman, buildah, runc and
# debootstrap (the container image test), chromium (the /docs test), promtool (the alert
# rules), nginx (the proxy beside Waldur, tests/agents/test_behind_proxy.py and
# test_tls_deployment.py). Installs the missing ones with apt when running as root on
# Debian; otherwise says what is missing and exits 0: those tests then skip, each saying
# why. Idempotent.
set -euo pipefail

log() { printf 'ensure-tools: %s\n' "$*" >&2; }

declare -A package_of=(
  [podman]=podman [buildah]=buildah [runc]=runc [debootstrap]=debootstrap
  [chromium]=chromium [promtool]=prometheus [nginx]=nginx-light
)
missing=()
for command in podman buildah runc debootstrap chromium promtool nginx; do
  if ! command -v "$command" >/dev/null 2>&1 && ! [ -x "/usr/sbin/$command" ]; then
    missing+=("${package_of[$command]}")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  log "missing ${missing[*]} (not root on a Debian machine): the tests that need them will skip;"
  log "install them with: sudo apt-get install ${missing[*]}"
  exit 0
fi
log "installing ${missing[*]} with apt"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# The prometheus and nginx packages would start a server: only their programs are wanted.
if printf '%s\n' "${missing[@]}" | grep -qxE 'prometheus|nginx-light'; then
  mkdir -p /usr/sbin && [ -e /usr/sbin/policy-rc.d ] || {
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  }
fi
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
log "installed ${missing[*]}"
