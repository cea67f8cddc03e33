"""trainflow: distributed deep-learning training scheduled by Apache Airflow 3.

The ``trainflow`` package is the Airflow-free core: the training spec, the plan, the
node agent and workers, checkpoints, heartbeats and the embedded-stack tooling. The
``operators`` and ``sensors`` packages are the thin Airflow adapters on top of it.
"""

__version__ = "0.1.0"
