from celery_ratelimit import Limit, Limiter


def test_allows_up_to_the_limit_then_denies(limiter: Limiter) -> None:
    limits = [Limit("3/s")]
    decisions = [limiter.acquire("k", limits) for _ in range(4)]
    assert [d.allowed for d in decisions] == [True, True, True, False]
    assert 0.9 < decisions[-1].retry_after <= 1.0
