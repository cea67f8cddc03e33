-- A database of its own for trainflow's state (allocator, host registry, rendezvous), never
-- Airflow's tables: the distributed profile's TRAINFLOW_STATE_DB (docs/guides/scale-out.md).
CREATE DATABASE trainflow OWNER airflow;
