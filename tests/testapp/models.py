"""Rows the tests' tasks and views write, so that tests can check from outside
what ran, when, and under which fencing token."""

from __future__ import annotations

from django.db import models


class RunLog(models.Model):
    label = models.CharField(max_length=100, db_index=True)
    task_id = models.CharField(max_length=255, blank=True)
    pid = models.IntegerField()
    token = models.BigIntegerField(null=True)
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True)

    def __str__(self) -> str:
        return f"{self.label} {self.task_id} pid {self.pid}"
