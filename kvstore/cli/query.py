"""``kvstore query``: where the longest cached prefix of a prompt is (the routers' question).

The prompt comes from a file (``-`` = stdin): token ids as a JSON list or
separated by blanks or commas (``--tokens-file``), or block hashes, one hex
hash per line (``--hashes-file``). The node answers from the Redis directory
when it has a cluster, else from its own store; a query is no hit.
"""

from __future__ import annotations

import json as jsonlib
import re
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from kvstore.api import wire
from kvstore.api.prefix import PrefixAnswer
from kvstore.cli.common import (
    DEFAULT_TARGET,
    Json,
    Target,
    Timeout,
    Token,
    column,
    connect,
    console,
    fail,
    print_json,
    table,
)
from kvstore.ops.plural import plural
from kvstore.v1 import kvstore_pb2 as pb

PromptFile = Annotated[
    str,
    typer.Option(
        help="File of the prompt's token ids (JSON list, or blank/comma separated; - = stdin)."
    ),
]
HashesFile = Annotated[
    str, typer.Option(help="File of the prompt's block hashes, one hex hash per line (- = stdin).")
]


def read_text(path: str) -> str:
    """The text of ``path`` (``-``: stdin); an unreadable file ends the command."""
    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text()
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror or exc}")


def parse_tokens(text: str) -> list[int]:
    """Token ids from a JSON list or from blank/comma separated integers."""
    stripped = text.strip()
    try:
        values: Any = jsonlib.loads(stripped) if stripped.startswith("[") else None
    except ValueError as exc:
        fail(f"the tokens file is not a JSON list: {exc}")
    if values is None:
        values = [v for v in re.split(r"[\s,]+", stripped) if v]
    try:
        tokens = [int(v) for v in values]
    except (TypeError, ValueError):
        fail("the tokens file must hold whole numbers (token ids)")
    if any(not 0 <= t < 1 << 32 for t in tokens):
        fail("token ids are 0 to 2**32-1")
    return tokens


def parse_hashes(text: str) -> list[bytes]:
    """Block hashes, one hex string per line."""
    try:
        return [bytes.fromhex(line.strip()) for line in text.splitlines() if line.strip()]
    except ValueError:
        fail("the hashes file must hold one hex hash per line")


def query(
    model: Annotated[str, typer.Option(help="Model id (the node's one namespace for it).")] = "",
    namespace: Annotated[str, typer.Option(help="Namespace id, instead of --model.")] = "",
    tokens_file: PromptFile = "",
    hashes_file: HashesFile = "",
    tenant: Annotated[str, typer.Option(help="Whose blocks (default: the caller's).")] = "",
    target: Target = DEFAULT_TARGET,
    token: Token = "",
    json: Json = False,
    timeout: Timeout = 5.0,
) -> None:
    """Which nodes, engines and tiers hold the longest prefix of a prompt (no hit counted)."""
    if bool(tokens_file) == bool(hashes_file):
        fail("give --tokens-file or --hashes-file, exactly one", 2)
    request = pb.QueryPrefixRequest(model=model, namespace_id=namespace, tenant_id=tenant)
    if tokens_file:
        request.packed_token_ids = wire.pack_tokens(parse_tokens(read_text(tokens_file)))
    else:
        request.packed_hashes = b"".join(parse_hashes(read_text(hashes_file)))
    with connect(target, timeout, token) as node:
        resp = node.stub.QueryPrefix(request, timeout=timeout, metadata=node.metadata)
    answer = PrefixAnswer.from_proto(resp)
    if json:
        print_json(answer.to_json())
        return
    t = table(
        f"{answer.model} ({answer.namespace_id}), tenant {answer.tenant_id}: "
        f"{plural(answer.query_blocks, 'block')} of {plural(answer.block_size, 'token')}, "
        f"from the {answer.source}"
    )
    for header, number in (
        ("node", False), ("address", False), ("tier", False), ("engine", False),
        ("blocks", True), ("tokens", True),
    ):  # fmt: skip
        column(t, header, number=number)
    for h in answer.holders:
        t.add_row(
            h.node_id, h.address or "-", h.tier, h.engine or "-",
            str(h.matched_blocks), str(h.matched_tokens),
        )  # fmt: skip
    console.print(t)
    if not answer.holders:
        console.print("nobody holds the first block of this prompt")


__all__ = ["query"]


COMMANDS = (query,)
"""The subcommands of this module; `kvstore.cli.app` registers them."""
