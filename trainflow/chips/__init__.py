"""Chip families: one adapter layer for every accelerator (see ``registry``)."""

from trainflow.chips.registry import FAMILIES, ChipFamily, get_family, queue_for

__all__ = ["FAMILIES", "ChipFamily", "get_family", "queue_for"]
