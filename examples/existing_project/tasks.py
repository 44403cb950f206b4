"""An existing project's tasks, declared the usual way: no base class, no decorator.

Nothing in this file knows about rate limits; ``celery.py`` next to it adds them.
"""

from __future__ import annotations

from celery import shared_task


@shared_task
def sync_invoices(account_id: int) -> str:
    """Pull one account's invoices from the billing provider (metered API)."""
    return f"synced invoices of account {account_id}"


@shared_task
def sync_customers(account_id: int) -> str:
    """Pull one account's customers from the same billing provider."""
    return f"synced customers of account {account_id}"


@shared_task
def send_email(to: str) -> str:
    """Send one e-mail through a provider that allows a few per second."""
    return f"sent to {to}"


@shared_task
def cleanup() -> str:
    """Housekeeping: no rule matches it, so it is never limited."""
    return "clean"
