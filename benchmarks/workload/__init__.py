"""The workload benchmark: generated multi-turn traffic replayed against emsd (see run.py)."""
