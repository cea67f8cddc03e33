-- A database of its own for trainflow's state (allocator, host registry, rendezvous), never
-- Airflow's tables. Prepared for the PostgreSQL state backend of the distributed profile,
-- which is not built yet: today that state is SQLite under TRAINFLOW_HOME (README, Scaling out).
CREATE DATABASE trainflow OWNER airflow;
