"""The scheduler: which requests run in the next step, and what happens to their results."""

from minijax_serve.scheduler.batch import ScheduleBatch, SchedulerLimits
from minijax_serve.scheduler.scheduler import Scheduler

__all__ = ["ScheduleBatch", "Scheduler", "SchedulerLimits"]
