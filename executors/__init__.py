"""Airflow executors shipped with trainflow (thin: the placement decisions are
``trainflow.cluster.allocator.Allocator.route``)."""
