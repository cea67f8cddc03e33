"""Adapters of third-party trainers to trainflow's SDK: ``trainflow.adapters.hf`` (Hugging
Face ``Trainer``) and ``trainflow.adapters.lightning`` (Lightning ``Trainer``). Each imports
its trainer only when used."""
