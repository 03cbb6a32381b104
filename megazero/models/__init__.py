"""Models, and the contract between a model family and everything else: its spec.

``megazero/parallel/`` never imports a model: it reads what the model declares (the parameter
attributes of :mod:`megazero.parallel.params`, ``zero3_plan()``, ``initial_value(name)``). The trainer,
checkpoints, the memory estimator and the tools import no concrete model either: they ask the registry
of :mod:`megazero.models.spec` for the family named by ``--model-family`` and use what its
:class:`~megazero.models.spec.ModelSpec` supplies (chunks, boundary shape, loss, FLOPs, step hooks,
the full-model builder, the HF adapter, the checkpoint's shape fields, activation memory).

The built-in family is ``gpt`` (:mod:`.gpt_spec`): GPT-2, and the Llama family and Mixture of Experts by
Megatron's flags, as Megatron's GPTModel does (the model: :mod:`.gpt`; its layers: :mod:`.transformer`,
:mod:`.moe`, :mod:`.rotary`; its HF formats: :mod:`.hf_gpt2`, :mod:`.hf_llama`). A different
architecture is a module of its own that registers a spec; nothing else changes.
"""
from megazero.models.spec import (HFAdapter, ModelSpec, StepHooks, build_model_chunks, get_model_spec,
                                  model_family_names, register_model_spec)

__all__ = ["HFAdapter", "ModelSpec", "StepHooks", "build_model_chunks", "get_model_spec", "model_family_names",
           "register_model_spec"]
