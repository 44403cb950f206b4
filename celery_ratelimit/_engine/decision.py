"""Decision: what the limiter answered for one call."""

from __future__ import annotations

from dataclasses import dataclass

from .exceptions import InvalidLimit
from .limit import Concurrency, Limit

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
        token: the call's token: the reservation to confirm when ``reserved``; when
            ``allowed``, what names the call to :meth:`Limiter.settle` and
            :meth:`Limiter.release` (16 hex digits, then the costs when not 1).
            ``None`` when denied.
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


def token_of(token_bytes: bytes, costs: tuple[int, ...]) -> str:
    """A call's token as a :class:`Decision` gives it: 16 hex digits, then, when a cost
    is not 1, ``"." + the costs`` (one, or one per limit, joined by ``","``), so that
    :meth:`Limiter.settle` knows what the call was counted at."""
    text = token_bytes.hex()
    if any(cost != 1 for cost in costs):
        if len(set(costs)) == 1:
            return f"{text}.{costs[0]}"
        return f"{text}.{','.join(str(cost) for cost in costs)}"
    return text


def parse_token(token: object) -> tuple[bytes, tuple[int, ...] | None]:
    """The bytes of a call's token (see :func:`token_of`) and the costs it carries (None:
    every cost was 1).

    Raises:
        InvalidLimit: anything else, which no call could be found by.
    """
    if isinstance(token, str):
        text, dot, costs = token.partition(".")
        if len(text) == 2 * TOKEN_BYTES:
            try:
                raw = bytes.fromhex(text)
                counted = tuple(int(one) for one in costs.split(",")) if dot else None
            except ValueError:
                pass
            else:
                if counted is None or (counted and all(one >= 0 for one in counted)):
                    return raw, counted
    raise InvalidLimit(
        f"not a reservation token: {token!r} (a token is the Decision.token that "
        f"acquire() returned: {2 * TOKEN_BYTES} hex digits, then the costs if not 1)"
    )


def token_bytes_of(token: object) -> bytes:
    """The bytes of a call's token (see :func:`parse_token`).

    Raises:
        InvalidLimit: not a token the limiter wrote.
    """
    return parse_token(token)[0]
