"""Memory per rank: the estimate before launch (``estimate.py``) and honest measurement (``measure.py``)."""
from megazero.memory.measure import (
                                     LastStepLiveBytes,
                                     LiveTensorBytes,
                                     describe_cpu_memory,
                                     reachable_tensor_bytes,
                                     return_freed_memory,
                                     reuse_freed_memory,
)

__all__ = ["LastStepLiveBytes", "LiveTensorBytes", "describe_cpu_memory", "reachable_tensor_bytes", "return_freed_memory",
           "reuse_freed_memory"]
