"""Turning a caller into acquire and release: ``@holds_permit`` on a Django
view (``views``) or a Celery task (``celery_tasks``), ``permit()`` around a
block (``context``), and the heartbeat that renews what they hold
(``leases``). Each calls the public operations (``api``) and nothing below."""
