"""The model families, one package each: its config class and rules, layers, spec and HF adapter.

``megazero/parallel/`` never imports a model: it reads what the model declares (the parameter
attributes of :mod:`megazero.parallel.params`, ``zero3_plan()``, ``initial_value(name)``). The trainer,
checkpoints, the memory estimator and the tools import no concrete model either: they ask the registry
(:mod:`megazero.spec`) for the family named by ``--model-family`` and use what its
:class:`~megazero.spec.ModelSpec` supplies.

The built-in family is ``gpt`` (:mod:`megazero.models.gpt`): GPT-2, and the Llama family and Mixture of
Experts by Megatron's flags. A different architecture is a package of its own that defines its config
class and registers a spec; nothing else changes.
"""
