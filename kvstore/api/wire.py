"""Wire forms of the values both sides of the API exchange: layouts and hash schemes.

One module owns this mapping so that the client and the service cannot
drift apart. It imports the generated protobuf messages but not grpc.
"""

from __future__ import annotations

from kvstore.errors import InvalidArgument
from kvstore.hashing import HashScheme
from kvstore.layout import KVLayout
from kvstore.v1 import kvstore_pb2 as pb

_SCHEMES: dict[int, HashScheme] = {
    pb.HASH_SCHEME_UNSPECIFIED: HashScheme.KVSTORE_SHA256,
    pb.HASH_SCHEME_KVSTORE_SHA256: HashScheme.KVSTORE_SHA256,
    pb.HASH_SCHEME_VLLM_SHA256_CBOR: HashScheme.VLLM_SHA256_CBOR,
}
_SCHEME_PROTO: dict[HashScheme, pb.HashScheme.ValueType] = {
    HashScheme.KVSTORE_SHA256: pb.HASH_SCHEME_KVSTORE_SHA256,
    HashScheme.VLLM_SHA256_CBOR: pb.HASH_SCHEME_VLLM_SHA256_CBOR,
}


def layout_to_proto(layout: KVLayout) -> pb.KVLayout:
    """The wire form of a KV layout."""
    return pb.KVLayout(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_size=layout.block_size,
        dtype=layout.dtype,
        kv_order=layout.kv_order,
    )


def layout_from_proto(msg: pb.KVLayout) -> KVLayout:
    """A `KVLayout` from its wire form; ``KVLayout`` validates the values.

    ``kv_order`` "" is the default order.
    """
    return KVLayout(
        num_layers=msg.num_layers,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        block_size=msg.block_size,
        dtype=msg.dtype,
        kv_order=msg.kv_order or "KV_LAYER_TOKEN_HEAD",
    )


def scheme_to_proto(scheme: HashScheme) -> pb.HashScheme.ValueType:
    """The enum value of a hash scheme."""
    return _SCHEME_PROTO[scheme]


def scheme_from_proto(value: int) -> HashScheme:
    """The hash scheme an enum value names (unspecified is the default scheme).

    Raises:
        InvalidArgument: the value names no scheme.
    """
    scheme = _SCHEMES.get(value)
    if scheme is None:
        raise InvalidArgument(f"unknown hash scheme {value}")
    return scheme
