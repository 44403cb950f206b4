from celery_ratelimit import Limit, Limiter


def test_allows_up_to_the_limit_then_denies(limiter: Limiter) -> None:
    limits = [Limit("3/s")]
    decisions = [limiter.acquire("k", limits) for _ in range(4)]
    assert [d.allowed for d in decisions] == [True, True, True, False]
    first, denied = decisions[0], decisions[-1]
    # exact: the oldest grant leaves the window one second after it was made
    assert round((denied.at + denied.retry_after - first.at) * 1e6) == 1_000_000
