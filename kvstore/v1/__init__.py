"""Generated from proto/kvstore/v1 by scripts/gen_proto.sh; do not edit."""
