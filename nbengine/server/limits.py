"""What the server allows: request limits and the bind rule (no web framework imported,
so ``nbengine --help`` works without the ``serve`` extra)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "DEFAULT_MAX_TOKENS",
    "MAX_JSON_DEPTH",
    "MAX_JSON_INT_DIGITS",
    "ServerLimits",
    "is_loopback",
]

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
DEFAULT_MAX_TOKENS = 4096
# A request body may nest arrays and objects this deep (OpenAI's requests need under
# 10): deeper ones are refused before decoding, so nothing downstream (the decoder,
# validation, a chat template) recurses without bound.
MAX_JSON_DEPTH = 64
# A JSON integer may have this many digits (a 64-bit seed has 20): longer ones are
# refused without converting them (str -> int takes quadratic time).
MAX_JSON_INT_DIGITS = 100


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one HTTP request may ask for."""

    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """Bodies above this many bytes are refused with 413."""
    max_tokens: int = DEFAULT_MAX_TOKENS
    """``max_tokens`` above this is refused with 400; chat's default when unset."""
    stream_interval: int = 1
    """Streams send a chunk every this many tokens after the first (vLLM's
    ``stream_interval``): fewer chunks, less server work per token, same TTFT."""


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
