"""Inference-engine integrations built on the ``ems`` SDK (each imports without its engine)."""
