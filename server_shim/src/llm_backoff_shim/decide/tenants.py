"""Who is calling, which classes it may use and what its limits are (``--tenants-file``).

A tenant is identified by its API key (``Authorization: Bearer ...``), or, with
``--tenant-header``, by that header's value. API keys are never stored: the file may
list a key in clear (hashed when loaded) or its short hash, and everything the shim
keeps, logs or exports is :func:`key_hash` (sha256, first 12 hex digits).

The file (JSON, or TOML when its name ends in ``.toml``)::

    {"default": {"requests_per_minute": 60, "tokens_per_minute": 40000},
     "tenants": [
       {"name": "chat-frontend", "key": "sk-...", "classes": ["interactive"],
        "requests_per_minute": 600},
       {"name": "nightly-evals", "key_hash": "3f1a9c0d2b7e", "classes": ["batch"]},
       {"name": "acme", "id": "acme", "tokens_per_minute": 1000000}]}

``default`` applies to callers the file does not list (the ``--tenant-*-per-minute``
flags fill in what it leaves out). ``classes`` bounds the classes a tenant may ask for
with ``x-request-class`` (others get a 403); the first one is its class when it sends
no header, unless ``default_class`` says otherwise.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from llm_backoff_shim.decide.requests import AdmissionRequest
from llm_backoff_shim.decide.tickets import Rejection
from llm_backoff_shim.decide.view import AdmissionView

_HASH = re.compile(r"[0-9a-f]{12}")


def key_hash(secret: str) -> str:
    """The only form in which an API key (or tenant id) is kept: sha256, first 12 hex digits."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()[:12]


class TenantsFileError(ValueError):
    """The tenants file cannot be read or is invalid; ``str()`` names the file and the problem."""


class TenantLimits(BaseModel):
    """Limits and class rights of one tenant (or the default); None: not limited / any class."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    requests_per_minute: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    tokens_per_minute: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    classes: tuple[str, ...] | None = Field(default=None, min_length=1)
    default_class: str | None = None

    @field_validator("classes")
    @classmethod
    def _lower(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        return None if value is None else tuple(v.strip().lower() for v in value)

    @model_validator(mode="after")
    def _default_allowed(self) -> TenantLimits:
        if (
            self.default_class is not None
            and self.classes is not None
            and self.default_class not in self.classes
        ):
            raise ValueError(f"default_class {self.default_class!r} is not in classes {list(self.classes)}")
        return self


class TenantEntry(TenantLimits):
    """A listed tenant: exactly one of ``key`` (clear API key), ``key_hash`` or ``id`` (header value)."""

    name: str | None = Field(default=None, max_length=200)
    key: str | None = Field(default=None, min_length=1, repr=False)
    key_hash: str | None = None
    id: str | None = Field(default=None, min_length=1, max_length=200)

    @field_validator("key_hash")
    @classmethod
    def _hash_form(cls, value: str | None) -> str | None:
        if value is not None and not _HASH.fullmatch(value.lower()):
            raise ValueError("key_hash must be 12 hex digits (sha256 of the key, first 12)")
        return None if value is None else value.lower()

    @model_validator(mode="after")
    def _one_identity(self) -> TenantEntry:
        given = [f for f in ("key", "key_hash", "id") if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError("each tenant needs exactly one of 'key', 'key_hash' or 'id'")
        return self

    @property
    def identity(self) -> str:
        """The lookup key: the key's hash, or the header value."""
        if self.key is not None:
            return key_hash(self.key)
        if self.key_hash is not None:
            return self.key_hash
        assert self.id is not None
        return self.id


class TenantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    default: TenantLimits = TenantLimits()
    tenants: tuple[TenantEntry, ...] = ()


def _read(path: Path) -> Any:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise TenantsFileError(f"tenants file {path}: {exc.strerror or exc}") from None
    try:
        if path.suffix.lower() == ".toml":
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # pragma: no cover - exercised on Python 3.10 only
                import tomli as tomllib
            return tomllib.loads(raw.decode("utf-8"))
        return json.loads(raw)
    except ValueError as exc:  # JSONDecodeError, TOMLDecodeError and UnicodeDecodeError are ValueErrors
        raise TenantsFileError(
            f"tenants file {path}: not valid {path.suffix.lstrip('.') or 'JSON'}: {exc}"
        ) from None


def load_tenants_file(path: Path, classes: Sequence[str]) -> TenantsFile:
    """Read and validate ``path``; every class named must be one of ``classes``."""
    data = _read(path)
    try:
        parsed = TenantsFile.model_validate(data)
    except ValidationError as exc:
        problems = []
        for error in exc.errors(include_url=False, include_input=False):
            where = ".".join(str(part) for part in error["loc"]) or "(top level)"
            problems.append(f"{where}: {str(error['msg']).removeprefix('Value error, ')}")
        raise TenantsFileError(f"tenants file {path}: " + "; ".join(problems)) from None
    seen: dict[str, int] = {}
    for index, entry in enumerate(parsed.tenants):
        if entry.identity in seen:
            raise TenantsFileError(
                f"tenants file {path}: tenants.{index} has the same identity as "
                f"tenants.{seen[entry.identity]}"
            )
        seen[entry.identity] = index
    for where, limits in [
        ("default", parsed.default),
        *((f"tenants.{i}", t) for i, t in enumerate(parsed.tenants)),
    ]:
        named = [*(limits.classes or ()), *([limits.default_class] if limits.default_class else [])]
        unknown = sorted(set(named) - set(classes))
        if unknown:
            raise TenantsFileError(
                f"tenants file {path}: {where} names unknown classes {unknown}; classes are {list(classes)}"
            )
    return parsed


@dataclass(frozen=True)
class Tenant:
    """A resolved caller: ``id`` is safe to log (a key hash, a header value or ``-``)."""

    id: str
    name: str | None
    limits: TenantLimits

    @property
    def label(self) -> str:
        return self.id if self.name is None else f"{self.name} ({self.id})"


ANONYMOUS = "-"


class TenantDirectory:
    """Maps request headers to a :class:`Tenant` with its effective limits."""

    def __init__(
        self,
        file: TenantsFile | None = None,
        *,
        header: str | None = None,
        requests_per_minute: float | None = None,
        tokens_per_minute: float | None = None,
    ) -> None:
        file = file or TenantsFile()
        # The flags fill in what the file's default leaves open.
        self.default = file.default.model_copy(
            update={
                "requests_per_minute": file.default.requests_per_minute or requests_per_minute,
                "tokens_per_minute": file.default.tokens_per_minute or tokens_per_minute,
            }
        )
        self._entries = {entry.identity: entry for entry in file.tenants}
        self.header = header.lower().encode("latin-1") if header else None

    @property
    def limited(self) -> bool:
        """Whether any tenant can have a quota (if not, the quota check is skipped)."""
        return any(
            t.requests_per_minute or t.tokens_per_minute for t in (self.default, *self._entries.values())
        )

    def identify(self, headers: Sequence[tuple[bytes, bytes]]) -> Tenant:
        return self.identify_id(self._identity(headers))

    def identify_id(self, identity: str) -> Tenant:
        """The tenant behind an identity :meth:`identify` produced (a key hash or header value)."""
        entry = self._entries.get(identity)
        if entry is None:
            return Tenant(identity, None, self.default)
        return Tenant(identity, entry.name, entry)

    def _identity(self, headers: Sequence[tuple[bytes, bytes]]) -> str:
        if self.header is not None:
            for name, value in headers:
                if name == self.header and value.strip():
                    return value.decode("latin-1").strip()[:200]
            return ANONYMOUS
        for name, value in headers:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").strip().partition(" ")
                if scheme.lower() == "bearer" and token.strip():
                    return key_hash(token.strip())
        return ANONYMOUS


class QuotaGate:
    """The :class:`~llm_backoff_shim.decide.view.AdmissionGate` that turns a request away when its
    tenant's quota said no (:class:`~llm_backoff_shim.decide.requests.QuotaVerdict`): 429
    ``tenant_rate_limited`` with the time until its buckets refill as the hint; a quota store
    that could not be asked is 503 ``upstream_unavailable`` with ``retry_after_min`` as the
    hint, as a shared quota that cannot be checked is never silently skipped. It runs first of
    the gates: a request over its quota is refused whatever the load."""

    def __init__(self, retry_after_min: float) -> None:
        self.retry_after_min = retry_after_min

    def check(self, request: AdmissionRequest, view: AdmissionView) -> Rejection | None:
        verdict = request.quota
        if verdict is None:
            return None
        if verdict.store_error is not None:
            return Rejection(
                code="upstream_unavailable",
                message=f"tenant quota store unavailable ({verdict.store_error})",
                retry_after=self.retry_after_min,
                status=503,
            )
        if verdict.retry_after is None:
            return None
        return Rejection(
            code="tenant_rate_limited",
            message=f"rate limit of tenant {verdict.tenant} reached",
            retry_after=verdict.retry_after,
            type="rate_limit_exceeded",
            status=429,
        )
