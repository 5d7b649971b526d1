#!/usr/bin/env bash
# One-shot check of the CUDA pool on a machine with an NVIDIA GPU.
#
#   scripts/gpu_check.sh [WHEEL_DIR]
#
# Installs cupy (from WHEEL_DIR, default ./wheels, when it holds a cupy wheel;
# else from the index), runs the GPU tests, then the CUDA benchmark. Prints one
# JSON object on stdout: environment, test outcome, benchmark numbers. Logs go
# to stderr. Exit status: 0 when the tests passed.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS="${1:-wheels}"
log() { echo "gpu_check: $*" >&2; }

if ! python -c "import cupy" 2>/dev/null; then
  if compgen -G "$WHEELS/cupy*.whl" >/dev/null; then
    log "installing cupy from $WHEELS"
    python -m pip install -q --no-index --find-links "$WHEELS" cupy-cuda12x >&2
  else
    log "installing cupy-cuda12x from the index"
    python -m pip install -q "cupy-cuda12x>=13" >&2
  fi
fi

ENV_JSON=$(python - <<'PY' 2>/dev/null || echo '{"error": "cupy or torch cannot see a GPU"}'
import json, cupy, torch
rt = cupy.cuda.runtime
print(json.dumps({
    "gpus": rt.getDeviceCount(),
    "name": torch.cuda.get_device_name(0),
    "cuda_runtime": rt.runtimeGetVersion(),
    "driver": rt.driverGetVersion(),
    "cupy": cupy.__version__,
    "torch": torch.__version__,
}))
PY
)

log "running the GPU tests"
TEST_LOG=$(mktemp)
timeout 300 python -m pytest -q -p no:cacheprovider -m cuda tests/gpu -rs >"$TEST_LOG" 2>&1
TEST_RC=$?
tail -n 30 "$TEST_LOG" >&2

log "running the benchmark"
BENCH_JSON=$(timeout 240 python -m benchmarks.bench_cuda 2>&2) || BENCH_JSON='{"error": "benchmark failed, see stderr"}'
[ -n "$BENCH_JSON" ] || BENCH_JSON='{"error": "no output"}'

python - "$TEST_RC" "$TEST_LOG" <<PY
import json, sys
rc, path = int(sys.argv[1]), sys.argv[2]
summary = open(path).read().strip().splitlines()[-1:] or [""]
print(json.dumps({
    "env": $ENV_JSON,
    "tests": {"exit_code": rc, "summary": summary[0]},
    "bench": $BENCH_JSON,
}, indent=2))
PY
exit $TEST_RC
