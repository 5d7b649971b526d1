#!/usr/bin/env bash
# Regenerate the Python modules of the API from proto/ (the one source of truth).
# The output lands in kvstore/v1/ (package kvstore.v1, as the proto package
# says), so the generated imports resolve without path tricks. Pinned
# grpcio-tools and mypy-protobuf (pyproject's "dev" extra) keep the output
# stable; tests/service/test_proto_fresh.py fails when it is stale.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
python -m grpc_tools.protoc \
  -Iproto \
  --python_out="$out" \
  --grpc_python_out="$out" \
  --mypy_out="$out" \
  --mypy_grpc_out="$out" \
  proto/kvstore/v1/kvstore.proto
printf '"""Generated from proto/kvstore/v1 by scripts/gen_proto.sh; do not edit."""\n' > "$out/kvstore/v1/__init__.py"
