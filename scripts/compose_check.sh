#!/usr/bin/env bash
# Runs docker-compose.yml in real containers, as a user would, and checks it
# (docs/deploy.md "How CI checks it"). Called by .ci/run; runs alone too, as root:
#
#   scripts/compose_check.sh
#
# 1. Installs Debian's docker.io and docker-compose (and mmdebstrap) if absent.
# 2. Uses the Docker engine that answers (DOCKER_HOST, else /var/run/docker.sock);
#    else starts a private dockerd whose data, socket and pidfile live in a state
#    directory, and stops it by its PID at exit. Its data root keeps the images
#    between runs, so a rerun rebuilds only what changed.
# 3. Base images: python:3.11-slim and redis:7-alpine where a registry answers;
#    else, once, a Debian bookworm image built with mmdebstrap (python3, a venv on
#    PATH, the host's CA certificates so pip's TLS works) and Debian's
#    redis-server on it; docker-compose.yml takes them through KVSTORE_BASE_IMAGE
#    and KVSTORE_REDIS_IMAGE.
# 4. Builds kvstore:dev and kvstore:hf (torch from TORCH_INDEX_URL; where PyTorch's
#    index cannot be reached, from a CPU wheel on this machine served on loopback).
# 5. Brings up redis, node-1 and node-2 on free host ports, runs `runner` (stores
#    on node-1, served by node-2 through Redis) and `chat-runner` (logits match),
#    and checks /metrics (node-2 fetched blocks from node-1), the web page,
#    `kvstore status` on both published ports and `kvstore nodes` (both nodes
#    live); then `down -v`.
#
# A failure prints the failing service's logs. Each phase prints its time.
# Environment: KVSTORE_COMPOSE_STATE (state directory), KVSTORE_TORCH_INDEX_URL,
# KVSTORE_BASE_IMAGE / KVSTORE_REDIS_IMAGE (skip the registry and local builds),
# KVSTORE_EXTRAS with KVSTORE_IMAGE (e.g. nixl and kvstore:nixl: the stack with NIXL).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

STATE=${KVSTORE_COMPOSE_STATE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvstore/compose}
PROJECT=kvstore-compose-check
LOCAL_BASE=kvstore-base:bookworm
LOCAL_REDIS=kvstore-base:bookworm-redis
mkdir -p "$STATE"
# One check at a time per state directory: a second waits here, so a private
# dockerd that answers below is a killed run's leftover, never a live run's.
# (What this script starts in the background does not inherit the lock.)
exec 9>"$STATE/lock"
flock -w 3600 9

START=$(date +%s)
PHASE=""
PHASE_START=$START
TIMINGS=()
phase() {  # phase NAME: ends the running phase (printing its time), starts NAME
  local now
  now=$(date +%s)
  if [ -n "$PHASE" ]; then
    TIMINGS+=("$(printf '%-28s %4d s' "$PHASE" $((now - PHASE_START)))")
    echo "compose_check: $PHASE: $((now - PHASE_START)) s"
  fi
  PHASE=$1
  PHASE_START=$now
  [ -z "$PHASE" ] || echo "compose_check: == $PHASE"
}

# --- cleanup: the stack, the loopback wheel server, the private dockerd -------
STACK_UP=0
SERVICE=""  # the services being checked: their logs are printed if the check fails
OWN_DOCKERD=""
PRE_IP_FORWARD=""  # what dockerd changes on the host, as it was before it started
PRE_FORWARD_POLICY=""
WHEEL_SERVER=""
cleanup() {
  local rc=$?
  set +e
  if [ "$rc" -ne 0 ]; then
    echo "compose_check: FAILED in phase '${PHASE}' (exit $rc)" >&2
    if [ "$STACK_UP" = 1 ]; then
      compose ps >&2
      if [ -n "$SERVICE" ]; then
        echo "compose_check: logs of $SERVICE:" >&2
        # shellcheck disable=SC2086  # one or more service names
        compose logs --no-color --tail=200 $SERVICE >&2
      else
        compose logs --no-color --tail=80 >&2
      fi
    fi
  fi
  if [ "$STACK_UP" = 1 ]; then
    phase "down -v"
    compose down -v --remove-orphans >/dev/null 2>&1 || compose down -v
  fi
  [ -z "$WHEEL_SERVER" ] || kill "$WHEEL_SERVER" 2>/dev/null
  if [ -n "$OWN_DOCKERD" ]; then
    kill "$OWN_DOCKERD" 2>/dev/null
    for _ in $(seq 60); do kill -0 "$OWN_DOCKERD" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$OWN_DOCKERD" 2>/dev/null; then
      echo "compose_check: dockerd $OWN_DOCKERD did not stop" >&2
    else
      # dockerd leaves its default network namespace bind-mounted in its exec root,
      # IP forwarding on and the FORWARD chain's policy at DROP: put back what it found.
      ! mountpoint -q "$STATE/exec/netns/default" || umount "$STATE/exec/netns/default"
      [ -z "$PRE_FORWARD_POLICY" ] || iptables -P FORWARD "$PRE_FORWARD_POLICY"
      [ -z "$PRE_IP_FORWARD" ] || echo "$PRE_IP_FORWARD" >/proc/sys/net/ipv4/ip_forward
      [ -z "$PRE_IP_FORWARD" ] || ip link delete docker0 2>/dev/null || true
      echo "compose_check: stopped dockerd $OWN_DOCKERD"
    fi
  fi
  phase ""
  echo "compose_check: timings"
  for t in "${TIMINGS[@]}"; do echo "  $t"; done
  echo "  $(printf '%-28s %4d s' total $(($(date +%s) - START)))"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- 1. tools ---------------------------------------------------------------
phase "install docker"
apt_install() {
  [ -n "${APT_UPDATED:-}" ] || { apt-get update -qq; APT_UPDATED=1; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}
if ! command -v dockerd >/dev/null || ! command -v docker-compose >/dev/null \
  || [ ! -x /usr/bin/docker ]; then
  apt_install docker.io docker-compose
fi
# Debian's client (/usr/bin/docker) matches Debian's dockerd and builds without
# buildx; a newer client earlier on PATH (/usr/local/bin) may need buildx to build.
DOCKER=/usr/bin/docker
compose() { docker-compose -p "$PROJECT" -f "$ROOT/docker-compose.yml" "$@"; }
"$DOCKER" --version
docker-compose version --short

# --- 2. the engine ------------------------------------------------------------
phase "start dockerd"
answers() { timeout 10 "$DOCKER" info >/dev/null 2>&1; }
if [ -z "${DOCKER_HOST:-}" ] && ! answers; then
  export DOCKER_HOST="unix://$STATE/docker.sock"
  if answers; then
    # A private dockerd left by a run that was killed: adopt it, stop it at exit,
    # and put back the host as that run found it.
    OWN_DOCKERD=$(cat "$STATE/dockerd.pid")
    read -r PRE_IP_FORWARD PRE_FORWARD_POLICY <"$STATE/host-before" || true
  else
    rm -f "$STATE/docker.sock" "$STATE/dockerd.pid"
    PRE_IP_FORWARD=$(cat /proc/sys/net/ipv4/ip_forward)
    PRE_FORWARD_POLICY=$(iptables -S FORWARD 2>/dev/null | awk '$1 == "-P" { print $3 }')
    echo "$PRE_IP_FORWARD $PRE_FORWARD_POLICY" >"$STATE/host-before"
    dockerd --data-root "$STATE/data" --exec-root "$STATE/exec" \
      --pidfile "$STATE/dockerd.pid" -H "$DOCKER_HOST" >"$STATE/dockerd.log" 2>&1 9>&- &
    OWN_DOCKERD=$!
    for _ in $(seq 60); do answers && break; sleep 0.5; done
    answers || { tail -20 "$STATE/dockerd.log" >&2; exit 1; }
  fi
  echo "compose_check: private dockerd $OWN_DOCKERD on $DOCKER_HOST (log: $STATE/dockerd.log)"
fi
answers || { echo "compose_check: no Docker engine answers on ${DOCKER_HOST:-the default socket}" >&2; exit 1; }
# Leftovers of a run that was killed before its `down -v`.
compose down -v --remove-orphans >/dev/null 2>&1 || true

# --- 3. base images -------------------------------------------------------------
phase "base images"
have() { "$DOCKER" image inspect "$1" >/dev/null 2>&1; }
free_port() { python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
# Once one pull has failed, the registry is taken as out of reach: no second wait.
REGISTRY=yes
pulled() {
  have "$1" && return 0
  [ "$REGISTRY" = yes ] || return 1
  timeout 300 "$DOCKER" pull -q "$1" >/dev/null 2>&1 && return 0
  REGISTRY=no
  return 1
}

build_local_base() {  # Debian bookworm + python3 and a venv on PATH, as python:3.11-slim has
  command -v mmdebstrap >/dev/null || apt_install mmdebstrap
  # The CA certificates added on this host (Debian's place for them), so that pip in
  # the image trusts what the host trusts: outgoing TLS may be re-signed by a proxy.
  local certs=/usr/local/share/ca-certificates
  # shellcheck disable=SC2016  # "$1" is the hooks' own argument: the new root
  mmdebstrap --quiet --variant=minbase \
    --include=python3,python3-venv,python3-pip,ca-certificates,passwd \
    --customize-hook="cp -r '$certs/.' \"\$1$certs/\"" \
    --customize-hook='chroot "$1" update-ca-certificates >/dev/null' \
    --customize-hook='chroot "$1" python3 -m venv /opt/venv' \
    --customize-hook='printf "[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n" > "$1/etc/pip.conf"' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
    bookworm - \
    | "$DOCKER" import \
      --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'ENV VIRTUAL_ENV=/opt/venv' \
      --change 'ENV LANG=C.UTF-8' \
      --change 'CMD ["python3"]' \
      - "$LOCAL_BASE" >/dev/null
}

if [ -n "${KVSTORE_BASE_IMAGE:-}" ]; then
  :
elif pulled python:3.11-slim; then
  export KVSTORE_BASE_IMAGE=python:3.11-slim
else
  have "$LOCAL_BASE" || { echo "compose_check: no registry; building $LOCAL_BASE"; build_local_base; }
  export KVSTORE_BASE_IMAGE=$LOCAL_BASE
fi
if [ -n "${KVSTORE_REDIS_IMAGE:-}" ]; then
  :
elif pulled redis:7-alpine; then
  export KVSTORE_REDIS_IMAGE=redis:7-alpine
else
  if ! have "$LOCAL_REDIS"; then
    echo "compose_check: no registry; building $LOCAL_REDIS (Debian's redis-server)"
    printf '%s\n' "FROM $KVSTORE_BASE_IMAGE" \
      'RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends redis-server >/dev/null && rm -rf /var/lib/apt/lists/*' \
      | "$DOCKER" build -q --force-rm -t "$LOCAL_REDIS" - >/dev/null
  fi
  export KVSTORE_REDIS_IMAGE=$LOCAL_REDIS
fi
echo "compose_check: base $KVSTORE_BASE_IMAGE, redis $KVSTORE_REDIS_IMAGE"

# --- 4. the project's images ----------------------------------------------------
phase "torch index"
# kvstore:hf installs torch from TORCH_INDEX_URL. Where PyTorch's CPU index cannot be
# reached, a CPU wheel of this machine's pip find-links is served as a one-package
# index on loopback, and that build uses the host's network to reach it.
TORCH_INDEX_URL=${KVSTORE_TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
HF_BUILD_NET=()
if [ -z "${KVSTORE_TORCH_INDEX_URL:-}" ] \
  && ! python3 -c "import urllib.request as u; u.urlopen('$TORCH_INDEX_URL/torch/', timeout=10)" 2>/dev/null; then
  wheel=""
  for dir in ${PIP_FIND_LINKS:-} $(python3 -m pip config get global.find-links 2>/dev/null || true); do
    for w in "$dir"/torch-*+cpu-cp311-cp311-*linux*_"$(uname -m)".whl; do
      [ -f "$w" ] && wheel=$w
    done
  done
  if [ -z "$wheel" ]; then
    echo "compose_check: $TORCH_INDEX_URL cannot be reached and no CPU torch wheel is here;" \
      "set KVSTORE_TORCH_INDEX_URL" >&2
    exit 1
  fi
  rm -rf "$STATE/torch-index" && mkdir -p "$STATE/torch-index/simple/torch"
  ln -s "$wheel" "$STATE/torch-index/simple/torch/"
  # A fixed port where it is free: the URL is a build argument, part of the layer
  # cache's key, so a new port each run would rebuild torch's layer each run.
  port=${KVSTORE_TORCH_INDEX_PORT:-38651}
  if ! python3 -c "import socket; socket.socket().bind(('127.0.0.1', $port))" 2>/dev/null; then
    port=$(free_port)
  fi
  python3 -m http.server --bind 127.0.0.1 --directory "$STATE/torch-index" "$port" \
    >"$STATE/torch-index.log" 2>&1 9>&- &
  WHEEL_SERVER=$!
  TORCH_INDEX_URL="http://127.0.0.1:$port/simple"
  HF_BUILD_NET=(--network host)
  echo "compose_check: torch from $(basename "$wheel") on $TORCH_INDEX_URL"
fi

phase "build kvstore:dev${KVSTORE_EXTRAS:+ ($KVSTORE_EXTRAS)}"
export KVSTORE_IMAGE=${KVSTORE_IMAGE:-kvstore:dev} KVSTORE_HF_IMAGE=${KVSTORE_HF_IMAGE:-kvstore:hf}
"$DOCKER" build -q --force-rm -t "$KVSTORE_IMAGE" --build-arg BASE_IMAGE="$KVSTORE_BASE_IMAGE" \
  --build-arg EXTRAS="${KVSTORE_EXTRAS:-}" .
phase "build kvstore:hf"
"$DOCKER" build -q --force-rm -t "$KVSTORE_HF_IMAGE" "${HF_BUILD_NET[@]}" \
  --build-arg BASE_IMAGE="$KVSTORE_BASE_IMAGE" --build-arg EXTRAS=hf \
  --build-arg TORCH_INDEX_URL="$TORCH_INDEX_URL" .
[ -z "$WHEEL_SERVER" ] || { kill "$WHEEL_SERVER"; WHEEL_SERVER=""; }

# --- 5. the stack -----------------------------------------------------------------
phase "stack up"
# Free host ports, so that a node or service already on 50051 or 9400 does not matter.
KVSTORE_NODE1_PORT=$(free_port) KVSTORE_NODE1_METRICS_PORT=$(free_port)
KVSTORE_NODE2_PORT=$(free_port) KVSTORE_NODE2_METRICS_PORT=$(free_port)
export KVSTORE_NODE1_PORT KVSTORE_NODE1_METRICS_PORT KVSTORE_NODE2_PORT KVSTORE_NODE2_METRICS_PORT
compose config -q
STACK_UP=1
compose up -d --no-build redis node-1 node-2
for node in node-1 node-2; do
  SERVICE=$node
  for _ in $(seq 60); do
    health=$("$DOCKER" inspect -f '{{.State.Health.Status}}' "$(compose ps -q "$node")")
    [ "$health" = healthy ] && break
    sleep 1
  done
  [ "$health" = healthy ] || { echo "compose_check: $node is $health" >&2; exit 1; }
done
SERVICE=""

phase "runner"
# A runner's container goes with --rm: its output is printed here, the nodes' logs
# by the failure handler.
SERVICE="node-1 node-2"
out=$(compose run --rm -T --no-deps runner 2>&1) || { echo "$out" >&2; exit 1; }
echo "$out" | tail -3
grep -q "synthetic_runner: ok" <<<"$out" || { echo "$out" >&2; exit 1; }

phase "chat-runner"
SERVICE="node-1"
out=$(compose run --rm -T --no-deps chat-runner 2>&1) || { echo "$out" >&2; exit 1; }
echo "$out" | tail -12
grep -q '"logits_match": true' <<<"$out" || { echo "$out" >&2; exit 1; }

phase "what a user sees"
# Whole pages, then grep (`curl | grep -q` fails under pipefail when grep stops early).
page() { curl -fsS --max-time 10 "http://127.0.0.1:$1/$2"; }
for node in node-1 node-2; do
  SERVICE=$node
  port=$KVSTORE_NODE1_METRICS_PORT
  [ "$node" = node-1 ] || port=$KVSTORE_NODE2_METRICS_PORT
  metrics=$(page "$port" metrics)
  grep -q '^kvstore_' <<<"$metrics" \
    || { echo "compose_check: $node's /metrics has no kvstore_ metric" >&2; exit 1; }
  web=$(page "$port" "")
  grep -qi '<html' <<<"$web" || { echo "compose_check: $node's web page is not HTML" >&2; exit 1; }
done
# The runner's blocks reached node-2 by a peer fetch from node-1 (found through Redis).
fetched=$(awk '/^kvstore_peer_fetched_blocks(_total)? /{print $2}' <<<"$metrics")
grep '^kvstore_peer_fetches' <<<"$metrics" | sed 's/^/  node-2 /' || true
if ! awk -v n="${fetched:-0}" 'BEGIN { exit !(n > 0) }'; then
  SERVICE="node-1 node-2"
  echo "compose_check: node-2 fetched no block from a peer (kvstore_peer_fetched_blocks ${fetched:-absent})" >&2
  exit 1
fi
echo "compose_check: node-2 fetched ${fetched%.0} blocks from node-1"
echo "compose_check: /metrics and / answer on both nodes"
# `kvstore status` on each published gRPC port, with this machine's CLI where the
# project is installed here (as in CI), else with the node image's, inside the node.
node_of() { python3 -c 'import json, sys; print(json.load(sys.stdin)["node_id"])'; }
for node in node-1 node-2; do
  SERVICE=$node
  port=$KVSTORE_NODE1_PORT
  [ "$node" = node-1 ] || port=$KVSTORE_NODE2_PORT
  if command -v kvstore >/dev/null; then
    status=$(kvstore status -t "127.0.0.1:$port" --json)
  else
    status=$(compose exec -T "$node" kvstore status -t 127.0.0.1:50051 --json)
  fi
  seen=$(node_of <<<"$status")
  [ "$seen" = "$node" ] || { echo "compose_check: port $port answers as $seen, not $node" >&2; exit 1; }
done
echo "compose_check: kvstore status: node-1 and node-2 answer on their published ports"
# `kvstore nodes` reads the Redis registry: from inside the stack, where Redis is.
SERVICE="node-1"
nodes=$(compose exec -T node-1 kvstore nodes --json)
for node in node-1 node-2; do
  grep -q "\"$node\"" <<<"$nodes" || { echo "compose_check: kvstore nodes lacks $node: $nodes" >&2; exit 1; }
done
echo "compose_check: kvstore nodes lists node-1 and node-2"
SERVICE=""

phase "down -v"
compose down -v --remove-orphans
STACK_UP=0
if [ -n "$OWN_DOCKERD" ]; then
  # Images this check's rebuilds left untagged: the data root stays its own size.
  "$DOCKER" image prune -f >/dev/null
fi
echo "compose_check: ok"
