"""The disk tier: a second, slower tier of blocks on a local file system, below the pool's DRAM.

``space`` places blocks in the tier's data file, ``ledger`` is its
persistent index, ``engine`` does the file I/O in threads, and ``disk`` ties
them together (demotion of evicted blocks, promotion on a hit).
"""
