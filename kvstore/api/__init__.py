"""The protobuf side of the API that the client SDK, the CLI and the service share.

The generated modules live in `kvstore.v1` (committed, produced by
``scripts/gen_proto.sh``); this package holds the hand-written mapping
between them and the core's domain types, so that the pure core
(`kvstore.hashing`, `kvstore.layout`, ...) never imports protobuf.
"""
