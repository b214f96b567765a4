"""Optional shim-side API keys: who may use the proxy at all.

Keys come from ``--api-key`` (one key; prefer the ``LLM_BACKOFF_SHIM_API_KEY``
variable, which does not show in ``ps``) and/or ``--api-keys-file`` (one key per
line; blank lines and lines starting with ``#`` are ignored). A client presents its
key as ``Authorization: Bearer <key>`` (what the openai SDK sends) or ``x-api-key: <key>``
(what Anthropic's SDKs send). Without keys
configured the shim is open.

Only SHA-256 digests of the keys are held after start-up. A key is identified in
logs and metrics by :func:`key_id` (``sha256:`` + the first 12 hex digits of its
digest), never by its text. The ``Authorization`` header is still forwarded to the
upstream unchanged, so a vLLM started with the same ``--api-key`` keeps working.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from pathlib import Path

RawHeaders = list[tuple[bytes, bytes]]


class KeysFileError(ValueError):
    """The keys file cannot be read or holds no usable key; ``str()`` is user-facing."""


def _digest(key: str | bytes) -> bytes:
    raw = key.encode("utf-8") if isinstance(key, str) else key
    return hashlib.sha256(raw).digest()


def key_id(key: str | bytes) -> str:
    """The short, non-reversible name of a key for logs and metrics."""
    return "sha256:" + _digest(key).hex()[:12]


def read_keys_file(path: str | Path) -> list[str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KeysFileError(f"cannot read API keys file {str(path)!r}: {exc}") from None
    keys = [line.strip() for line in text.splitlines()]
    keys = [k for k in keys if k and not k.startswith("#")]
    if not keys:
        raise KeysFileError(f"API keys file {str(path)!r} holds no key")
    for number, key in enumerate(keys, 1):
        if any(c.isspace() for c in key):
            raise KeysFileError(f"API keys file {str(path)!r}: key {number} contains whitespace")
    return keys


def bearer_token(headers: RawHeaders) -> bytes | None:
    """The credential of an ``Authorization: Bearer ...`` header, or None.

    Without an ``Authorization`` header, an ``x-api-key`` header (what Anthropic's SDKs send)
    is the credential.
    """
    api_key: bytes | None = None
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
        if name == b"x-api-key" and api_key is None and value.strip():
            api_key = value.strip()
    return api_key


class ApiKeys:
    """The accepted keys, held as digests. Empty: authentication is off."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = tuple({_digest(k) for k in keys if k})

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def check(self, token: bytes | None) -> bool:
        """Whether ``token`` is one of the keys; constant time per stored key."""
        if token is None:
            return False
        digest = _digest(token)
        found = False
        for known in self._digests:
            # No early exit: the time taken does not tell which key came close.
            found |= hmac.compare_digest(known, digest)
        return found
