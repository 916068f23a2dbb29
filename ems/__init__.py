"""The ``ems`` SDK: the Huawei Cloud EMS Python API, served by a local emsd.

Import paths kept from EMS::

    from ems import Ems, EmsConfig, CcConfig, CcConfig_v1, CcKvOption, CcResult, \\
        CcFuture, EmsException, EmsErrorCode, KvBufferWrapper
    from ems.cc_v1.cc_config import KVCacheType
    from ems.common.exception import EmsErrorCode
"""

from ems.buffer import KvBufferWrapper
from ems.cc_v1.cc_config import CcConfig_v1, KVCacheType
from ems.common.exception import EmsErrorCode, EmsException
from ems.config import CcKvOption, EmsConfig
from ems.ems import Ems
from ems.result import CcFuture, CcResult

CcConfig = CcConfig_v1

__all__ = [
    "CcConfig",
    "CcConfig_v1",
    "CcFuture",
    "CcKvOption",
    "CcResult",
    "Ems",
    "EmsConfig",
    "EmsErrorCode",
    "EmsException",
    "KVCacheType",
    "KvBufferWrapper",
]
