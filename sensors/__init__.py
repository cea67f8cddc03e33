"""Deferrable sensors of trainflow (and their triggers, importable by the triggerer)."""
