"""Models, and the contract between a model and the parallel machinery.

``megazero/parallel/`` never imports a model: it reads what the model declares. A model module
(``gpt.py``; the next one goes beside it) supplies:

======================================  ==========================================  ======================
what                                    how (GPT)                                   read by
======================================  ==========================================  ======================
its pipeline chunks                     ``build_model_chunks(model_cfg, parallel_   the trainer; chunk c
                                        cfg, topo, seed, dtype, device)``: the      of pipeline rank r is
                                        ``v`` chunks of this rank; parameter        virtual stage c*pp + r
                                        names are the full model's
the stage boundary                      ``activation_shape(model_cfg, micro_batch,  ``run_schedule``
                                        tp, sequence_parallel)``                    (receive buffers)
its loss                                ``masked_mean(per_token_loss, loss_mask)``  ``run_schedule``
                                        over the last chunk's ``chunk(x, labels)``  (``loss_fn=``)
its ZeRO-3 gather units                 ``chunk.zero3_plan()``                      ZeRO-3
                                        (:mod:`megazero.parallel.zero.units`)
which parameters are split (on which    parameter attributes                        ZeRO, norms, counts,
dim), tied, or vocabulary-padded        (:mod:`megazero.parallel.params`)           checkpoints, tools
======================================  ==========================================  ======================

Tools that need the declarations without a process group build the model on the meta device
(``GPT(cfg, device="meta")``): every name and attribute, no memory.

The GPT covers GPT-2 and the Llama family (RoPE, RMSNorm, SwiGLU, grouped-query attention, bias-free
layers) through Megatron's flags, as Megatron's GPTModel does (its layers: ``transformer.py``); a
different architecture would be a module of its own beside it, providing the same contract.
"""
from megazero.models.gpt import GPT, activation_shape, build_model_chunks, masked_mean

__all__ = ["GPT", "activation_shape", "build_model_chunks", "masked_mean"]
