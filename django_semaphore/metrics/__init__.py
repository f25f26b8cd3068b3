"""Prometheus metrics for django-semaphore, an optional app of its own.

Add ``"django_semaphore.metrics"`` to ``INSTALLED_APPS`` (it needs
``prometheus_client``: ``pip install "django-semaphore[metrics]"``) and mount
``django_semaphore.metrics.urls``. Every process that loads the app counts
its own grants, waits, releases and retries (``events``), web and Celery
workers alike; the per-semaphore gauges are read from the database at scrape
time (``collector``). Importing this package needs nothing beyond Django.
"""
