"""docs/config.md, generated from the `Config` schema: ``python -m service.config.docs``."""

from __future__ import annotations

from service.config.schema import ENV_PREFIX, Config, field_docs, field_names

DERIVED = {"node_id"}
"""Fields whose empty default is filled in at start (`service.config.resolve`)."""


def _show_default(name: str, value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value >> 20}MiB" if value < 1 << 30 else f"{value >> 30}GiB"
    if isinstance(value, bytes):
        return "(random)" if not value else value.hex()
    if isinstance(value, tuple):
        return ",".join(value) or "(none)"
    if value == "":
        return "(derived)" if name in DERIVED else "(empty)"
    return str(value)


def render_markdown() -> str:
    """Markdown table of every setting: name, flag, environment variable, default, meaning."""
    docs = field_docs()
    lines = [
        "# Configuration",
        "",
        "Generated from `service/config/schema.py` by `python -m service.config.docs`;"
        " do not edit.",
        "",
        "Precedence: flags > environment > config file (`--config file.toml|.json` or",
        "`KVSTORE_CONFIG`, keys are the field names) > defaults.",
        "",
        "The `disk_*` settings are the disk tier below the memory pools: see",
        "[disk.md](disk.md).",
        "",
        "| Field | Flag | Environment | Default | Meaning |",
        "|---|---|---|---|---|",
    ]
    defaults = Config()
    for name in field_names():
        default = _show_default(name, getattr(defaults, name))
        if name == "pool_file_mode":
            default = oct(defaults.pool_file_mode)
        flag = "--" + name.replace("_", "-")
        lines.append(
            f"| `{name}` | `{flag}` | `{ENV_PREFIX}{name.upper()}` | `{default}` | {docs[name]} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_markdown(), end="")
