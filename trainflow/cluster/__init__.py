"""Cluster state: node capacity and gang allocations (leases)."""
