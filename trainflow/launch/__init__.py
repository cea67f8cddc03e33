"""Launching a run's node agents: the agent itself and a local (no-Airflow) launcher."""
