"""Decision: what the limiter answered for one call."""

from __future__ import annotations

from dataclasses import dataclass

from ._exceptions import InvalidLimit
from ._limit import Concurrency, Limit

#: A reservation token: this many random bytes, written as hex by the limiter.
TOKEN_BYTES = 8


@dataclass(frozen=True, slots=True)
class Decision:
    """The answer to one :meth:`Limiter.acquire` (or ``peek``) call.

    Attributes:
        allowed: the call may run now (or, only when the caller asked the limiter to
            ``hold``, ``retry_after`` seconds from now); its cost has been counted.
        remaining: weight still free in the tightest limit, counting reservations.
        retry_after: seconds until this cost fits every limit (0.0 when allowed now).
            For a reservation, the seconds until the reserved slot.
        reset_after: seconds until every limit of the call is back to full.
        limit: the limit that set ``retry_after`` when denied, else ``None``.
        reserved: a future slot was reserved for this call (``allowed`` is False; run it
            ``retry_after`` seconds from now and confirm with ``token``).
        token: the call's token (hex): the reservation to confirm when ``reserved``;
            when ``allowed`` (``"log"`` algorithm), the name of the call's entry in the
            log. ``None`` when denied.
        at: the Redis server time of the decision, or of the reserved slot, in seconds
            since the epoch.
        paused: denied (or placed later) because the key is paused
            (:meth:`Limiter.pause`, ``UpstreamRateLimited``).
    """

    allowed: bool
    remaining: int
    retry_after: float
    reset_after: float
    limit: Limit | Concurrency | None = None
    reserved: bool = False
    token: str | None = None
    at: float = 0.0
    paused: bool = False

    def __bool__(self) -> bool:
        return self.allowed


def token_bytes_of(token: object) -> bytes:
    """The bytes of a reservation token as :meth:`Limiter.acquire` wrote it (16 hex
    digits).

    Raises:
        InvalidLimit: anything else, which no reservation could be found by.
    """
    if isinstance(token, str) and len(token) == 2 * TOKEN_BYTES:
        try:
            return bytes.fromhex(token)
        except ValueError:
            pass
    raise InvalidLimit(
        f"not a reservation token: {token!r} (a token is the Decision.token that "
        f"acquire(..., reserve=True) returned: {2 * TOKEN_BYTES} hex digits)"
    )
