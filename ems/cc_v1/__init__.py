"""Version 1 of the context-caching config (``CcConfig_v1``, ``KVCacheType``)."""

from ems.cc_v1.cc_config import CcConfig, CcConfig_v1, KVCacheType

__all__ = ["CcConfig", "CcConfig_v1", "KVCacheType"]
