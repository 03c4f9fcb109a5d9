"""Tenant isolation of the prefix cache: every tenant's requests carry their own cache salt.

Without it the prefix cache is shared by every client, and `usage.prompt_tokens_details.
cached_tokens` (or the time to first token) tells one client whether another sent a prefix.
`conveyor serve --cache-salt-from SOURCE` names who the tenant of a request is:

    api-key        the API key it was authorized with (--api-key takes several, one per tenant)
    header:NAME    the value of header NAME, which a trusted gateway in front of the server
                   sets (and strips from what clients send); no such header is the tenant "",
                   and the header given twice is a 400
    none           nobody: one prefix cache shared by every client (an explicit opt-in)
    (not given)    api-key when several API keys are configured (secure by default: keys are
                   handed to different clients), else none

The request's cache salt is then always the tenant's, combined with the request's own
`cache_salt` if it has one:

    salt = "tenant-" + hex(sha256(DOMAIN + sha256(tenant) + request's cache_salt))

sha256(tenant) has a fixed length, so a tenant can pick any cache_salt and still never reach
another tenant's salt (nor share blocks with it); requests of one tenant with the same (or no)
cache_salt share as before. The API key is hashed per request and never stored.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass

from conveyor.sampling_params import check_cache_salt

_DOMAIN = b"conveyor-tenant-salt-v1\x00"
# An HTTP field name (RFC 9110's token).
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
SHARED = "none"  # --cache-salt-from none: one prefix cache shared by every client
CACHE_SALT_SOURCES = f"api-key or header:NAME (or {SHARED}: one cache shared by all)"


def bearer_credentials(authorization: bytes) -> bytes:
    """The key of an `Authorization: Bearer <key>` value (the scheme in any case), or b""."""
    scheme, _, credentials = authorization.strip().partition(b" ")
    return credentials.strip() if scheme.lower() == b"bearer" else b""


@dataclass(frozen=True, slots=True)
class TenantSalt:
    """Where a request's tenant comes from (see the module docstring).

    Args:
        header: the lower-case header that names the tenant (b"authorization" for api-key).
        from_api_key: the tenant is the header's bearer key, not its whole value.
    """

    header: bytes
    from_api_key: bool

    @classmethod
    def parse(cls, source: str) -> TenantSalt:
        """`api-key` or `header:NAME` (`none` is tenant_salt's, not a tenant source).

        Raises:
            ValueError: anything else (the message starts with `cache_salt_from`).
        """
        if source == "api-key":
            return cls(b"authorization", True)
        kind, _, name = source.partition(":") if isinstance(source, str) else ("", "", "")
        if kind != "header" or not _HEADER_NAME.fullmatch(name):
            raise ValueError(f"cache_salt_from must be {CACHE_SALT_SOURCES}, got {source!r}.")
        return cls(name.lower().encode("latin-1"), False)

    def tenant(self, headers: Iterable[tuple[bytes, bytes]]) -> bytes:
        """The tenant of a request with these (ASGI, lower-case) headers.

        Raises:
            APIError: the tenant header appears more than once (400).
        """
        values = [v for k, v in headers if k == self.header]
        if len(values) > 1:
            from conveyor.server.errors import APIError  # here: server/config.py imports us

            name = self.header.decode("latin-1")
            raise APIError(f"The header {name!r} names the tenant and must be sent once.")
        value = values[0] if values else b""
        return bearer_credentials(value) if self.from_api_key else value.strip()

    def cache_salt(self, headers: Iterable[tuple[bytes, bytes]], request_salt: str | None) -> str:
        """The salt a request runs with: its tenant's, combined with its own `cache_salt`.

        Raises:
            APIError: an invalid cache_salt (400 naming it), or a repeated tenant header.
        """
        if request_salt is not None:
            try:
                check_cache_salt(request_salt)
            except ValueError as exc:
                from conveyor.server.errors import APIError

                raise APIError(str(exc), param="cache_salt") from exc
        tenant = hashlib.sha256(self.tenant(headers)).digest()
        own = b"" if request_salt is None else request_salt.encode("utf-8", "surrogatepass")
        return "tenant-" + hashlib.sha256(_DOMAIN + tenant + own).hexdigest()


def tenant_salt(source: str | None, num_api_keys: int) -> TenantSalt | None:
    """Where each request's tenant comes from (`source`: ServerConfig.cache_salt_from), or
    None for one cache shared by all; ValueError for a source not in CACHE_SALT_SOURCES."""
    if source is None:  # secure by default: several keys are several clients
        return TenantSalt.parse("api-key") if num_api_keys > 1 else None
    return None if source == SHARED else TenantSalt.parse(source)
