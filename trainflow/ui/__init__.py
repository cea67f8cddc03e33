"""What the training page shows: pure reads of run workspaces into JSON-able dicts.

The Airflow plugin (``plugins/trainflow_ui.py``) serves them; nothing here imports airflow.
"""
