"""Workloads: what is trained. Built-ins plus user workloads by import path."""

from trainflow.workloads.base import Workload, load_workload

__all__ = ["Workload", "load_workload"]
