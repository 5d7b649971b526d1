"""Value parsers of the configuration: strings (flags, environment) to typed values.

Each raises `ValueError` with a message that `service.config` prefixes with
the field name and where the value came from.
"""

from __future__ import annotations

import re
from collections.abc import Callable

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_SIZE_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(value: object) -> int:
    """Bytes from an int or a size string: ``"512"``, ``"64MiB"``, ``"1GiB"``, ``"512M"``.

    Binary multiples throughout (``M`` = ``MiB`` = 2**20): memory sizes are
    what these configure, and nobody means 10**6 bytes of shared memory.
    """
    if isinstance(value, bool):
        raise ValueError("expected a size, got a boolean")
    if isinstance(value, int):
        number = value
    else:
        match = _SIZE_RE.match(str(value))
        if match is None:
            raise ValueError(f"expected a size like 512M, 64MiB or 1GiB, got {value!r}")
        number = int(float(match.group(1)) * 1024 ** _SIZE_POWERS[match.group(2).lower()])
    if number < 0:
        raise ValueError(f"a size cannot be negative, got {value!r}")
    return number


def parse_int(value: object) -> int:
    if isinstance(value, bool):
        raise ValueError("expected an integer, got a boolean")
    if isinstance(value, int):
        return value
    try:
        return int(str(value).strip(), 0)
    except ValueError:
        raise ValueError(f"expected an integer, got {value!r}") from None


def parse_float(value: object) -> float:
    if isinstance(value, bool):
        raise ValueError("expected a number, got a boolean")
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"expected a number, got {value!r}") from None


def parse_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def parse_str(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def parse_secret(value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    text = str(value).strip()
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise ValueError("expected hex digits (e.g. from `openssl rand -hex 32`)") from None
    if secret and len(secret) < 16:
        raise ValueError(f"a salt secret needs at least 16 bytes, got {len(secret)}")
    return secret


def parse_names(value: object) -> tuple[str, ...]:
    items = [str(v) for v in value] if isinstance(value, (list, tuple)) else str(value).split(",")
    return tuple(item.strip() for item in items if item.strip())


def parse_event_encoding(value: object) -> str:
    """The encoding of published KV events: "map" or "array" (docs/events.md)."""
    text = str(value).strip().lower()
    if text not in ("map", "array"):
        raise ValueError(f'expected "map" or "array", got {value!r}')
    return text


def parse_verify_checksums(value: object) -> str:
    """Where block checksums are checked: "peer" (peer fetches) or "all" (also local loads)."""
    text = str(value).strip().lower()
    if text not in ("peer", "all"):
        raise ValueError(f'expected "peer" or "all", got {value!r}')
    return text


def parse_port(value: object) -> int:
    port = parse_int(value)
    if not 0 <= port <= 65535:
        raise ValueError(f"expected a port in [0, 65535], got {port}")
    return port


def parse_positive(parse: Callable[[object], int]) -> Callable[[object], int]:
    def check(value: object) -> int:
        number = parse(value)
        if number <= 0:
            raise ValueError(f"must be positive, got {value!r}")
        return number

    return check


def parse_non_negative(parse: Callable[[object], int]) -> Callable[[object], int]:
    def check(value: object) -> int:
        number = parse(value)
        if number < 0:
            raise ValueError(f"cannot be negative, got {value!r}")
        return number

    return check


def parse_positive_float(value: object) -> float:
    number = parse_float(value)
    if not number > 0:
        raise ValueError(f"must be a positive number of seconds, got {value!r}")
    return number


def parse_non_negative_float(value: object) -> float:
    number = parse_float(value)
    if number < 0:
        raise ValueError(f"cannot be negative, got {value!r}")
    return number


def parse_log_level(value: object) -> str:
    level = parse_str(value).upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError(f"expected DEBUG, INFO, WARNING, ERROR or CRITICAL, got {value!r}")
    return level


def parse_device(value: object) -> str:
    text = parse_str(value).strip()
    if text.lower() == "cpu":
        return "cpu"
    if text.lower() == "cuda":
        return "cuda:0"
    rest = text[len("cuda:") :] if text.lower().startswith("cuda:") else text
    if rest.isdigit() or (rest.upper().startswith(("GPU-", "MIG-")) and len(rest) > 4):
        return f"cuda:{rest}"
    raise ValueError(f"expected cpu, cuda:N or cuda:GPU-<uuid>, got {value!r}")


def parse_file_mode(value: object) -> int:
    try:
        mode = parse_int(value) if not isinstance(value, str) else int(value, 8)
    except ValueError:
        raise ValueError(
            f"expected octal permission bits like 600 or 0o660, got {value!r}"
        ) from None
    if not 0 <= mode <= 0o777:
        raise ValueError(f"expected permission bits like 0o600, got {value!r}")
    if mode & 0o007:
        raise ValueError(f"pool files must not be world accessible, got {mode:o}")
    return mode


def parse_peer_transport(value: object) -> str:
    mode = parse_str(value).strip().lower()
    if mode not in ("auto", "nixl", "grpc"):
        raise ValueError(f"expected auto, nixl or grpc, got {value!r}")
    return mode


def parse_huge_pages(value: object) -> str:
    mode = parse_str(value).strip().lower()
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"expected auto, on or off, got {value!r}")
    return mode
