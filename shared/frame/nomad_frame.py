"""Nomad's frames, Python's side: a 4-byte big-endian length, then that many bytes of body.

The Rust side is the `nomad-frame` crate beside this file; the gateway ships this module beside
its sandbox runner, the device worker beside its model host. Each protocol's limit is declared
once, in Rust, and reaches this end in the environment (`limit`). The module imports only `os`
(loaded at every interpreter's start), so a sandbox run started on demand pays for no import.
"""

import os

HEADER = 4


class FrameTooLarge(ValueError):
    """A frame over its protocol's limit, refused before any of its body is read or sent."""

    def __init__(self, length, limit):
        super().__init__(f"frame of {length} bytes exceeds the {limit}-byte limit")
        self.length = length
        self.limit = limit


def limit(protocol):
    """`protocol`'s frame limit in bytes, as the Rust end declared it (`NOMAD_<PROTOCOL>_MAX_FRAME`)."""
    name = f"NOMAD_{protocol.upper()}_MAX_FRAME"
    value = os.environ.get(name, "")
    if not value.isdigit():
        raise RuntimeError(
            f"{name} is {value!r}, not a number of bytes: the Nomad process that starts this one sets it"
        )
    return int(value)


def length(header, limit):
    """The body length `header` (4 bytes) declares; over `limit` raises `FrameTooLarge`."""
    n = int.from_bytes(header, "big")
    if n > limit:
        raise FrameTooLarge(n, limit)
    return n


def pack(body, limit):
    """`body` (bytes) as one frame; over `limit` raises `FrameTooLarge`."""
    if len(body) > limit:
        raise FrameTooLarge(len(body), limit)
    return len(body).to_bytes(HEADER, "big") + body


def read(read_exact, limit):
    """One frame's body. `read_exact(n)` returns exactly `n` bytes or raises `EOFError`."""
    return read_exact(length(read_exact(HEADER), limit))


def fields(body):
    """The text fields of a fields frame (each a 4-byte length and UTF-8 text)."""
    out = []
    i = 0
    while i < len(body):
        n = int.from_bytes(body[i : i + HEADER], "big")
        i += HEADER
        out.append(body[i : i + n].decode("utf-8"))
        i += n
    return out
