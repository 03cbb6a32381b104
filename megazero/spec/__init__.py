"""The model contract: what a model family supplies and everything else relies on. Between
``megazero/parallel/`` (which knows process groups and tensors, never a model) and ``megazero/models/``
(the families): the trainer, checkpoints, the memory estimator and the tools import this package, never a
concrete model.

==================  ===================================================================================
module              what
==================  ===================================================================================
``model_spec``      :class:`ModelSpec` (a family's chunks, loss, FLOPs, hooks, HF adapter, ...),
                    :class:`StepHooks`, :class:`HFAdapter`
``registry``        :func:`register_model_spec`, :func:`get_model_spec` (by ``--model-family``),
                    :func:`build_model_chunks` (this rank's chunks)
``recompute``       the meaning of the ``--recompute-*`` flags, which any family's layers apply
``activations``     the activation-memory protocol and the generic transformer formula (the estimator's)
``kv_cache``        the KV-cache contract generation uses
==================  ===================================================================================
"""
from megazero.spec.model_spec import HFAdapter, ModelSpec, StepHooks
from megazero.spec.registry import (
           build_model_chunks,
           get_model_spec,
           register_model_spec,
           spec_for_hf,
)

__all__ = ["HFAdapter", "ModelSpec", "StepHooks", "build_model_chunks", "get_model_spec", "register_model_spec",
           "spec_for_hf"]
