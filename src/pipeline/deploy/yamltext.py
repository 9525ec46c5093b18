"""Block-style YAML for Kubernetes manifests, without a YAML library.

Manifests are plain trees of dicts, lists, strings, ints and bools. A string stays plain
only when no YAML reader could take it for anything else; multi-line text (a profile)
becomes a literal block; everything else is double-quoted with YAML escapes.
"""

from __future__ import annotations

import re
from typing import Any

_PLAIN = re.compile(r"[A-Za-z_/$][A-Za-z0-9_./:@$()\[\]'-]*")
_SPECIAL = {"y", "n", "yes", "no", "on", "off", "true", "false", "null"}
_INDENT = "  "


def _printable(ch: str) -> bool:
    code = ord(ch)
    if 0x20 <= code <= 0x7E:
        return True
    if code in (0x2028, 0x2029, 0xFEFF):
        return False
    return 0xA0 <= code <= 0xD7FF or 0xE000 <= code <= 0xFFFD or 0x10000 <= code <= 0x10FFFF


def quote(text: str) -> str:
    """A YAML double-quoted scalar: every character not printable is escaped."""
    out = ['"']
    for ch in text:
        if ch in '\\"':
            out.append("\\" + ch)
        elif _printable(ch):
            out.append(ch)
        elif ord(ch) <= 0xFF:
            out.append(f"\\x{ord(ch):02x}")
        elif ord(ch) <= 0xFFFF:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    out.append('"')
    return "".join(out)


def _plain_ok(text: str) -> bool:
    return (
        bool(_PLAIN.fullmatch(text))
        and text.lower() not in _SPECIAL
        and "$(" not in text
        and not text.endswith(":")
    )


def scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return value if _plain_ok(value) else quote(value)
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as YAML")


def _block_ok(text: str) -> bool:
    """Whether `text` survives a literal block (`|`) unchanged."""
    body = text[:-1]
    return (
        "\n" in body
        and text.endswith("\n")
        and not body.endswith("\n")
        and not text[0].isspace()
        and all(ch == "\n" or (_printable(ch) and ch != "\t") for ch in text)
    )


def _lines(value: Any, depth: int) -> list[str]:
    """The lines of a dict or list at `depth` (the caller writes the key or dash)."""
    pad = _INDENT * depth
    out: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            out += _entry(f"{pad}{scalar(str(key))}:", item, depth)
    else:
        for item in value:
            out += _entry(f"{pad}-", item, depth, in_list=True)
    return out


def _entry(head: str, item: Any, depth: int, *, in_list: bool = False) -> list[str]:
    if isinstance(item, str) and _block_ok(item):
        pad = _INDENT * (depth + 1)
        return [f"{head} |", *[f"{pad}{line}" if line else "" for line in item[:-1].split("\n")]]
    if isinstance(item, dict | list):
        if not item:
            return [f"{head} {'{}' if isinstance(item, dict) else '[]'}"]
        nested = _lines(item, depth + 1)
        if in_list and isinstance(item, dict):
            # "- key: value" on the dash line, the other keys aligned under it
            first = nested[0].lstrip()
            return [f"{head} {first}", *nested[1:]]
        return [head, *nested]
    return [f"{head} {scalar(item)}"]


def dump(document: dict[str, Any]) -> str:
    return "\n".join(_lines(document, 0)) + "\n"


def dump_all(documents: list[dict[str, Any]], header: list[str] | None = None) -> str:
    """A multi-document stream: the header as comments, then each document after `---`."""
    text = "".join(f"# {line}".rstrip() + "\n" for line in header or [])
    return text + "".join(f"---\n{dump(doc)}" for doc in documents)
