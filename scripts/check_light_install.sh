#!/usr/bin/env bash
# `pip install .` without torch gives a working node, runner SDK and CLI.
#
# In a fresh venv in a temporary directory (removed at the end): install this
# tree with no extras, check that torch is not there, start a node on host
# memory (port 0), store, look up and read blocks through numpy views with the
# SDK, check that asking for a torch view names the extra, and run the CLI
# (`kvstore --help`, `kvstore status --target`). Exits non-zero on any failure.
#
#   scripts/check_light_install.sh            # uses python3
#   PYTHON=python3.12 scripts/check_light_install.sh
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
work="$(mktemp -d "${TMPDIR:-/tmp}/kvstore-light.XXXXXX")"
node_pid=""
cleanup() {
  if [[ -n "$node_pid" ]] && kill -0 "$node_pid" 2>/dev/null; then
    kill -TERM "$node_pid" 2>/dev/null || true
    wait "$node_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT
start=$(date +%s)

# A copy of the tree (tracked and untracked-but-not-ignored files): building
# leaves build/ and *.egg-info behind, and they stay out of the checkout.
mkdir "$work/src"
if git -C "$repo" rev-parse --git-dir >/dev/null 2>&1; then
  (cd "$repo" && git ls-files -z --cached --others --exclude-standard \
    | xargs -0 -I{} sh -c 'test -e "$1" && printf "%s\0" "$1"' _ {} \
    | tar --null -T - -cf -) | tar -C "$work/src" -xf -
else
  tar -C "$repo" --exclude=.git --exclude=build --exclude='*.egg-info' -cf - . | tar -C "$work/src" -xf -
fi

"$python" -m venv "$work/venv" || { echo "light install: needs python3 -m venv (Debian: apt-get install python3-venv)" >&2; exit 1; }
py="$work/venv/bin/python"
unset PYTHONPATH
"$py" -m pip install -q "$work/src"
echo "light install: installed in $(( $(date +%s) - start )) s"

# Run everything from an empty directory: `import kvstore` must be the installed one.
mkdir "$work/run" "$work/shm"
cd "$work/run"
if "$py" -c "import torch" 2>/dev/null; then
  echo "light install: torch got installed by 'pip install .'; it must be an extra" >&2
  exit 1
fi
"$py" -c "import kvstore, os, sys; assert os.path.realpath(kvstore.__file__).startswith(os.path.realpath(sys.prefix)), kvstore.__file__"

"$work/venv/bin/kvstore-server" --port 0 --metrics-port 0 --shm-dir "$work/shm" \
  --capacity-bytes 16MiB >"$work/node.log" 2>&1 &
node_pid=$!
target=""
for _ in $(seq 1 300); do  # up to 30 s for the "listening on" line
  target="$(sed -n 's/^kvstore-server listening on //p' "$work/node.log")"
  [[ -n "$target" ]] && break
  kill -0 "$node_pid" 2>/dev/null || { cat "$work/node.log" >&2; exit 1; }
  sleep 0.1
done
[[ -n "$target" ]] || { echo "light install: node did not start" >&2; cat "$work/node.log" >&2; exit 1; }
echo "light install: node on $target"

KVSTORE_TARGET="$target" "$py" - <<'PY'
import os

import numpy as np

from kvstore import KVLayout
from kvstore.client import SyncClient
from kvstore.extras import MissingExtra

layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
tokens = list(range(100, 112))  # three full blocks
with SyncClient(os.environ["KVSTORE_TARGET"], tenant="light") as kv:
    ns = kv.register_namespace("light-model", layout)
    blocks = [np.full(layout.block_shape, i + 1, np.float16) for i in range(3)]
    assert kv.store(ns, tokens, blocks).committed == 3
    hit = kv.lookup(ns, tokens, pin=True)
    assert hit.hit_tokens == 12, hit.hit_tokens
    views = hit.numpy_views()  # zero-copy, straight from the node's pool file
    assert [float(v.flat[0]) for v in views] == [1.0, 2.0, 3.0]
    try:
        hit.torch_views()
    except MissingExtra as exc:
        assert "kvstore[torch]" in str(exc), exc
    else:
        raise AssertionError("torch views worked without torch")
    kv.release(hit)
print("light install: SDK stored, looked up and read 3 blocks through numpy views")
PY

"$work/venv/bin/kvstore" --help >/dev/null
"$work/venv/bin/kvstore" status --target "$target" --json | "$py" -c \
  "import json,sys; d=json.load(sys.stdin); assert d['used_blocks']==3, d; print('light install: kvstore status sees', d['used_blocks'], 'blocks')"

kill -TERM "$node_pid"
wait "$node_pid"
node_pid=""
echo "light install: ok in $(( $(date +%s) - start )) s (no torch)"
