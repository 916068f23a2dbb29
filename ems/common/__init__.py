"""Pieces of the SDK shared by its modules (errors)."""
