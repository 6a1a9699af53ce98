"""Procedural tasks with exactly checkable answers."""
