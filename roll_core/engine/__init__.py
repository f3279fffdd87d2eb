"""Cluster / executor plumbing: local and Ray executors, dispatch of a Batch across ranks."""

from roll_core.engine.cluster import Cluster
from roll_core.engine.executors import LocalExecutor, RayExecutor, make_executor
from roll_core.engine.worker import Worker

__all__ = ["Cluster", "LocalExecutor", "RayExecutor", "Worker", "make_executor"]
