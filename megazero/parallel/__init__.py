"""Parallelism over process groups and tensors, never a model: the topology and its typed group views,
tensor and sequence parallel layers, context parallel attention, pipeline schedules and their executor,
and the ZeRO engine (``zero/``)."""
