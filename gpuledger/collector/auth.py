"""Bearer-token authentication and the access rules of the collector's endpoints.

Three roles: a ``node`` token is bound to one host name and may only POST that host's samples (a token bound to a
cluster as well: only batches naming that cluster or none, collector.validate); a ``read`` token may GET the query
endpoints; an ``admin`` token may do what ``read`` may and also POST job records.
Tokens are compared in constant time, and every configured token is compared on every request, so
neither the timing of a comparison nor of the whole lookup says which prefix or which token matched.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

Role = Literal["node", "read", "admin"]
# Who may call an endpoint: public (no token even with auth on), node (sample writers), read, admin.
Access = Literal["public", "node", "read", "admin"]


@dataclass(frozen=True, slots=True)
class Principal:
    role: Role
    name: str  # the host name for a node token; "admin" or "read" otherwise
    cluster: str | None = None  # the cluster a node token is bound to; None: any (the batch names it)


class ClusterBoundToken(Protocol):
    """A node token bound to a cluster as well as to its host (config's ``{ token = "...", cluster = "..." }``)."""

    @property
    def token(self) -> str: ...

    @property
    def cluster(self) -> str: ...


class AuthError(Exception):
    """401 (no or unknown token) or 403 (a valid token without the right): ``status`` and ``message``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _digest(token: str) -> bytes:
    # Equal-length digests: compare_digest is constant-time only for inputs of the same length.
    return hashlib.sha256(token.encode()).digest()


class Authenticator:
    """Maps an ``Authorization: Bearer <token>`` header to a :class:`Principal`."""

    def __init__(
        self,
        node_tokens: Mapping[str, str | ClusterBoundToken] | None = None,
        admin_tokens: Iterable[str] = (),
        read_tokens: Iterable[str] = (),
    ) -> None:
        entries = [(_digest(t), Principal("node", host)) if isinstance(t, str) else
                   (_digest(t.token), Principal("node", host, t.cluster)) for host, t in (node_tokens or {}).items()]
        entries += [(_digest(t), Principal("admin", "admin")) for t in admin_tokens]
        entries += [(_digest(t), Principal("read", "read")) for t in read_tokens]
        self._entries = tuple(entries)

    @property
    def enabled(self) -> bool:
        return bool(self._entries)

    def identify(self, authorization: str | None) -> Principal | None:
        """The principal of a valid bearer token, else None."""
        if not authorization:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        presented = _digest(token.strip())
        found: Principal | None = None
        for digest, principal in self._entries:  # no early exit: the time taken does not depend on the match
            if hmac.compare_digest(digest, presented):
                found = principal
        return found

    def authorize(self, authorization: str | None, access: Access, what: str) -> Principal | None:
        """Check a request for an endpoint; returns its principal (None when auth is off or the endpoint public)."""
        if access == "public" or not self.enabled:
            return None
        principal = self.identify(authorization)
        if principal is None:
            raise AuthError(401, f"{what}: a valid bearer token is required (Authorization: Bearer <token>)")
        allowed = {"node": ("node",), "read": ("read", "admin"), "admin": ("admin",)}[access]
        if principal.role not in allowed:
            need = {"node": "a node token", "read": "a read-only or admin token", "admin": "an admin token"}[access]
            raise AuthError(403, f"{what}: needs {need}; this is a {principal.role} token")
        return principal
