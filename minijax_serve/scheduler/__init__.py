"""The scheduler: which requests run in the next step, and what happens to their results."""

from minijax_serve.scheduler.scheduler import ScheduleBatch, Scheduler, SchedulerLimits

__all__ = ["ScheduleBatch", "Scheduler", "SchedulerLimits"]
