"""Thin Airflow operators over the trainflow core."""
