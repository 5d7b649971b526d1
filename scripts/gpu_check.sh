#!/usr/bin/env bash
# One-shot check of the CUDA pool on a machine with an NVIDIA GPU.
#
#   scripts/gpu_check.sh [WHEEL_DIR]
#
# Installs cupy (from WHEEL_DIR, default ./wheels, when it holds a cupy wheel;
# else from the index), then, each step under its own timeout (about 8.5 minutes
# in all, so it fits one 10-minute device call):
#
#   1. env:    GPU, driver, cupy, torch; every GPU's UUID as cupy gives it (raw
#              length: 16, or cut at a zero byte), as kvstore reads it, and as
#              libcuda and torch give it (they must agree);
#   2. tests:  the GPU tests (tests/gpu, marked cuda), one outcome per test:
#              IPC store/read across processes, a killed runner, a restarted
#              node, release after queued reads, SyncClient on the caller's
#              stream and GPU, 2 MiB-aligned arenas, UUIDs, an arena of a dropped
#              namespace kept (not cudaFree'd) while a runner still has it open;
#              the disk tier under a CUDA pool, across a restart;
#   3. fake:   the CPU tests of the same code on the fake runtime (they must
#              pass here too: torch with CUDA must not change them);
#   4. bench:  python -m benchmarks.bench_cuda (mapped bandwidth vs. a plain
#              torch copy, prefix load time);
#   5. release: what waiting for the reads costs a release (tests/gpu/_release_cost.py).
#
# Prints one JSON object on stdout; logs go to stderr. Exit status: 0 when the
# GPU tests and the fake-runtime tests passed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
WHEELS="${1:-wheels}"
OUT=$(mktemp -d)
log() { echo "gpu_check: $*" >&2; }

# Never install anything on a machine without a GPU (cupy would load, find no driver,
# and stay behind in that Python).
if ! nvidia-smi -L >/dev/null 2>&1; then
  log "no NVIDIA GPU here (nvidia-smi -L failed): nothing to check"
  echo '{"error": "no NVIDIA GPU (nvidia-smi -L failed)"}'
  exit 2
fi

if ! python -c "import cupy" 2>/dev/null; then
  if compgen -G "$WHEELS/cupy*.whl" >/dev/null; then
    log "installing cupy from $WHEELS"
    python -m pip install -q --no-index --find-links "$WHEELS" cupy-cuda12x >&2
  else
    log "installing cupy-cuda12x from the index"
    python -m pip install -q "cupy-cuda12x>=13" >&2
  fi
fi

log "1/5 environment and device UUIDs"
timeout 30 python - >"$OUT/env.json" 2>"$OUT/env.err" <<'PY' || echo '{"error": "cupy or torch cannot see a GPU"}' >"$OUT/env.json"
import json, cupy, torch
from kvstore.pool.cuda_runtime import CupyRuntime, format_uuid, uuid_from_driver, uuid_from_torch
rt = cupy.cuda.runtime
kv = CupyRuntime()
gpus = []
for i in range(rt.getDeviceCount()):
    raw = bytes(rt.getDeviceProperties(i)["uuid"])
    driver, from_torch = uuid_from_driver(i), uuid_from_torch(i)
    gpus.append({
        "ordinal": i,
        "cupy_raw_len": len(raw),
        "kvstore": kv.device_uuid(i),
        "libcuda": format_uuid(driver) if driver else None,
        "torch": format_uuid(from_torch) if from_torch else None,
    })
print(json.dumps({
    "gpus": gpus,
    "name": torch.cuda.get_device_name(0),
    "cuda_runtime": rt.runtimeGetVersion(),
    "driver": rt.driverGetVersion(),
    "cupy": cupy.__version__,
    "torch": torch.__version__,
}))
PY
cat "$OUT/env.err" >&2

log "2/5 GPU tests"
timeout 240 python -m pytest -q -p no:cacheprovider -m cuda tests/gpu -rs \
  --junitxml="$OUT/gpu.xml" >"$OUT/gpu.log" 2>&1
GPU_RC=$?
tail -n 40 "$OUT/gpu.log" >&2

log "3/5 fake-runtime tests of the same code"
timeout 60 python -m pytest -q -p no:cacheprovider tests/kvstore/pool \
  tests/service/test_cuda_device.py tests/service/test_cuda_client.py \
  tests/service/test_cuda_held_arenas.py \
  "tests/service/test_disk_node.py::test_a_cuda_pool_goes_to_disk_and_comes_back" \
  --junitxml="$OUT/fake.xml" >"$OUT/fake.log" 2>&1
FAKE_RC=$?
tail -n 15 "$OUT/fake.log" >&2

log "4/5 benchmark"
timeout 120 python -m benchmarks.bench_cuda >"$OUT/bench.json" 2>>"$OUT/bench.err" ||
  echo '{"error": "benchmark failed, see stderr"}' >"$OUT/bench.json"
cat "$OUT/bench.err" >&2

log "5/5 release cost"
timeout 60 python -m tests.gpu._release_cost >"$OUT/release.json" 2>>"$OUT/release.err" ||
  echo '{"error": "release cost failed, see stderr"}' >"$OUT/release.json"
cat "$OUT/release.err" >&2

python - "$OUT" "$GPU_RC" "$FAKE_RC" <<'PY'
import json, sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, gpu_rc, fake_rc = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])

def load(name):
    try:
        text = (out / name).read_text().strip()
        return json.loads(text) if text else {"error": "no output"}
    except (OSError, ValueError) as exc:
        return {"error": f"{name}: {exc}"}

def outcomes(name):
    try:
        root = ET.parse(out / name).getroot()
    except (OSError, ET.ParseError) as exc:
        return {"error": f"{name}: {exc}"}
    result = {}
    for case in root.iter("testcase"):
        key = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        state = "passed"
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                state = f"{tag}: {(node.get('message') or '')[:200]}"
                break
        result[key] = state
    return result

def summary(name):
    lines = (out / name).read_text().strip().splitlines() if (out / name).exists() else []
    return lines[-1] if lines else ""

print(json.dumps({
    "env": load("env.json"),
    "gpu_tests": {"exit_code": gpu_rc, "summary": summary("gpu.log"), "tests": outcomes("gpu.xml")},
    "fake_tests": {"exit_code": fake_rc, "summary": summary("fake.log")},
    "bench": load("bench.json"),
    "release_cost": load("release.json"),
}, indent=2))
PY
[ "$GPU_RC" -eq 0 ] && [ "$FAKE_RC" -eq 0 ]
