"""The GPT decoder (Megatron's GPTModel): GPT-2 by default, Llama-family with flags; a whole model
or a pipeline stage.

Shape: pre-norm blocks ``x + Dropout(Attn(Norm(x)))``, ``x + Dropout(MLP(Norm(x)))``, causal
attention via ``F.scaled_dot_product_attention``, a final norm, and the output layer tied to the word
embedding unless ``untie_embeddings_and_output_weights``. The defaults are GPT-2 (LayerNorm, learned
positions, GELU, biases); a Llama-family model is the same class with ``--position-embedding-type
rope --normalization RMSNorm --swiglu --group-query-attention --num-query-groups G
--disable-bias-linear --untie-embeddings-and-output-weights`` (the layers: :mod:`.transformer`).

Parameter names are the same on every tp/pp layout (a stage simply lacks what it does not own)::

    embedding.word_embeddings.weight              [V_pad/tp, h]   split dim 0 (vocab rows)
    embedding.position_embeddings.weight          [max_pos, h]    replicated (first stage; learned only)
    layers.<i>.input_layernorm.{weight,bias}      [h]             replicated (RMSNorm: weight only)
    layers.<i>.attention.qkv.{weight,bias}        [3h/tp, h]      split dim 0, see SelfAttention
    layers.<i>.attention.query.{weight,bias}      [heads*d/tp, h] split dim 0  } --group-query-attention,
    layers.<i>.attention.key_value.{weight,bias}  [2G*d/tp, h]    split dim 0, } see GroupedQueryAttention
                                                  or [2G*d, h] replicated when G < tp
    layers.<i>.attention.dense.weight             [h, h/tp]       split dim 1;  .bias [h] replicated
    layers.<i>.post_attention_layernorm.{weight,bias}
    layers.<i>.mlp.dense_h_to_4h.{weight,bias}    [ffn/tp, h]     split dim 0 ([2ffn/tp, h] with SwiGLU, see MLP)
    layers.<i>.mlp.dense_4h_to_h.weight           [h, ffn/tp]     split dim 1;  .bias [h] replicated
    layers.<i>.mlp.router.weight, layers.<i>.mlp.experts.<e>.fc{1,2}.*   MoE layers instead of the MLP
                                                  (--num-experts; replicated over tp, see moe.py)
    final_norm.{weight,bias}                      [h]             (last stage only)
    output_layer.weight                           [V_pad/tp, h]   only when untied

Biases exist unless ``--disable-bias-linear`` (the QKV ones stay with ``--add-qkv-bias``). A norm
weight is the norm's scale (initialised to 1), or with ``--apply-layernorm-1p`` the scale - 1 (initialised
to 0; checkpoints hold this stored value). ``<i>`` is
the *global* layer index. With tied embeddings a last stage that is not also the first (pipeline)
still owns ``embedding.word_embeddings.weight`` (same init, ``shared_embedding=True``,
``tied_copy=True``); the ZeRO engine sums the two copies' gradients over the embedding group.

What the model declares for the parallel machinery (its spec: :mod:`megazero.models.gpt.spec`):
one chunk per pipeline placement, :func:`activation_shape` (the stage boundary), :func:`masked_mean`
(the loss over per-token losses), :meth:`GPT.zero3_plan` (the ZeRO-3 gather units),
:meth:`GPT.initial_value` (sharded construction) and the parameter attributes of
:mod:`megazero.parallel.params` (split dims, the tied embedding, the padded vocabulary, the partial
gradients of replicated key/value heads).

Padded vocabulary: rows ``vocab_size .. V_pad-1`` of the word embedding (and untied output layer)
are initialised to zero and their logits are set to -inf inside the model, so padded entries never
receive probability mass (in the loss or in returned logits) and never get a gradient.

Layout-independent init: every parameter is drawn WHOLE (its tp=1 shape; vocab rows beyond
``vocab_size`` zero) from a CPU ``torch.Generator`` seeded by ``hash(seed, parameter name)`` and then
sliced for this tp rank, so one seed gives the same full model for any tp/pp.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import nn

from megazero.config import FLAG
from megazero.memory.activation_offload import ActivationOffload
from megazero.models.gpt.config import GPTConfig
from megazero.models.gpt.moe import ExpertMLP
from megazero.models.gpt.transformer import (
    Embedding,
    LayerContext,
    ReplicatedLinear,
    TransformerLayer,
    qkv_blocks_to_interleaved,
    qkv_interleaved_to_blocks,
)
from megazero.parallel.fp8 import FP8Layer, Splits
from megazero.parallel.groups import ModelParallelGroups
from megazero.parallel.pipeline.split_backward import weight_grad_in_input
from megazero.parallel.raw_comm import group_rank
from megazero.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelRNG,
    column_parallel_linear,
    init_std_scaled,
    mask_padded_vocab,
    set_tp_attributes,
    shard,
    vocab_parallel_cross_entropy,
    vocab_parallel_linear_cross_entropy,
)
from megazero.parallel.zero.units import UnitUse, Zero3Plan, trainable
from megazero.spec.kv_cache import KVCache
from megazero.spec.recompute import checkpointed, full_recompute_groups

__all__ = ["GPT", "activation_shape", "masked_mean", "param_seed", "qkv_blocks_to_interleaved",
           "qkv_interleaved_to_blocks"]


def masked_mean(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """sum(loss * mask) / sum(mask) as a scalar (0 when the mask is empty)."""
    mask = loss_mask.to(per_token_loss.dtype)
    total = mask.sum()
    return torch.where(total > 0, (per_token_loss * mask).sum() / total.clamp(min=1e-30),
                       torch.zeros((), dtype=per_token_loss.dtype, device=per_token_loss.device))


def param_seed(seed: int, name: str) -> int:
    """The generator seed of parameter ``name`` (stable across processes and Python versions)."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class GPT(nn.Module):
    """The GPT model, or the part of it one pipeline stage owns.

    ``GPT(cfg, groups=None, layer_ids=None, pre_process=True, post_process=True, seed=1234,
    dtype=torch.float32, device=None, home_device=None)``: ``groups`` the tensor- and expert-parallel
    groups (``topo.model_groups(sequence_parallel)``; None: one process); ``home_device`` this rank's
    device (default CPU), where parameters built on ``device="meta"`` will be materialised.
    ``forward(x, labels=None, *, kv_cache=None)``:

    - ``x``: token ids [b, s] int64 when ``pre_process``, else hidden [s(/tp), b, h] from the
      previous stage;
    - returns per-token loss [b, s] float32 (``post_process`` and labels), this rank's logits shard
      [b, s, V_pad/tp] (``post_process``, no labels; padded entries -inf), else hidden [s(/tp), b, h];
    - ``kv_cache`` (inference, :class:`megazero.spec.kv_cache.KVCache`, one per chunk): ``x`` continues
      the tokens the cache holds, at positions ``kv_cache.length ..``; the chunk's layers append theirs.
    """

    def __init__(self, model_cfg: GPTConfig, groups: ModelParallelGroups | None = None, *,
                 layer_ids: Sequence[int] | None = None, pre_process: bool = True, post_process: bool = True,
                 seed: int = 1234, dtype=torch.float32, device=None, home_device=None):
        super().__init__()
        cfg = model_cfg
        groups = groups or ModelParallelGroups.single()
        tp = groups.tp.size
        home_device = torch.device(home_device) if home_device is not None else torch.device("cpu")
        device = torch.device(device) if device is not None else home_device
        layer_ids = list(range(cfg.num_layers)) if layer_ids is None else list(layer_ids)
        self.pre_process, self.post_process, self.layer_ids = pre_process, post_process, layer_ids
        self.tied = not cfg.untie_embeddings_and_output_weights
        self.padded_vocab_size = cfg.padded_vocab_size(tp)
        tp_group = groups.tp.group if tp > 1 else None
        self.rng = TensorParallelRNG(seed, group_rank(tp_group), offset=100 * min(layer_ids, default=0),
                                     device=device if device.type != "meta" else home_device)
        ctx = self.ctx = LayerContext(cfg, groups, self.rng, dtype, device)
        self.cfg, self.tp_group, self.sequence_parallel = cfg, ctx.tp_group, ctx.sp

        if pre_process or (post_process and self.tied):
            self.embedding = Embedding(ctx, self.padded_vocab_size, with_positions=pre_process)
            word = self.embedding.word_embeddings.weight
            word.vocab_padded = word.embedding_or_output = True
            word.shared_embedding = self.tied
            word.tied_copy = self.tied and not pre_process   # the last stage's copy of stage 0's tensor
        self.layers = nn.ModuleDict({str(i): self.build_layer(ctx, i) for i in layer_ids})
        if post_process:
            self.final_norm = ctx.norm()
            if not self.tied:
                self.output_layer = ColumnParallelLinear(cfg.hidden_size, self.padded_vocab_size, tp_group,
                                                         bias=False, sequence_parallel=self.sequence_parallel,
                                                         dtype=dtype, device=device)
                self.output_layer.weight.vocab_padded = self.output_layer.weight.embedding_or_output = True
            # its weight gradient is computed in a split backward's I, not held for W (split_backward.py)
            weight_grad_in_input(self.embedding.word_embeddings.weight if self.tied else self.output_layer.weight)
        self.add_modules(ctx)
        for p in self.layers.parameters():
            p.layer_matrix = p.dim() == 2
        for p in self.parameters():
            if not hasattr(p, "tensor_parallel"):
                set_tp_attributes(p, False)
        self.seed = seed
        self.head_fp8 = None                          # the tied head's FP8 scaling, under --fp8-head
        self._norm_modules = {n for n, m in self.named_modules() if getattr(m, "is_norm", False)}  # ctx.norm()'s
        self.recompute_groups = full_recompute_groups(cfg, len(layer_ids))
        self.activation_offload = None                # --cpu-offloading: the first offloaded_layers layers
        self.offloaded_layers = 0
        if cfg.cpu_offloading:
            self.activation_offload = ActivationOffload(device if device.type != "meta" else home_device)
            self.offloaded_layers = min(cfg.cpu_offloading_num_layers or len(layer_ids), len(layer_ids))
        if device.type != "meta":          # on the meta device the ZeRO engine materialises them
            self.reset_parameters(seed)

    def build_layer(self, ctx: LayerContext, layer_id: int) -> nn.Module:
        """Global layer ``layer_id`` of this chunk (a family built on GPT returns its own layer here)."""
        return TransformerLayer(ctx, layer_id)

    def add_modules(self, ctx: LayerContext) -> None:
        """Modules a family built on GPT adds to the chunk after GPT's own, before every parameter is
        initialised (GPT adds none)."""

    # ------------------------------------------------------------------ init
    def reset_parameters(self, seed: int) -> None:
        """Fill every parameter from its whole-tensor init (see module docstring), sliced for this rank."""
        self.seed = seed
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(self.initial_value(name))

    def initial_value(self, name: str) -> torch.Tensor:
        """This tp rank's initial value of parameter ``name`` (float32, CPU): the whole tensor drawn
        from its (seed, name) generator, then sliced. The ZeRO engine calls it for a chunk built on
        the meta device, to materialise each parameter where it will live (part of the model contract)."""
        p = self.get_parameter(name)
        tp, rank = self.ctx.tp_size, self.ctx.tp_rank
        full_shape = list(p.shape)
        if p.tensor_parallel:
            full_shape[p.partition_dim] *= tp
        is_norm = name.rpartition(".")[0] in self._norm_modules
        return shard(self.full_init(name, tuple(full_shape), self.seed, is_norm=is_norm), p.partition_dim, rank, tp)

    def full_init(self, name: str, shape: tuple[int, ...], seed: int, is_norm: bool = False) -> torch.Tensor:
        """The tp=1 value of parameter ``name`` (float32, CPU): GPT-2 init, deterministic in (seed, name)."""
        cfg = self.cfg
        if name.endswith(".bias"):
            return torch.zeros(shape)
        if is_norm:                                      # --apply-layernorm-1p stores scale - 1
            return torch.zeros(shape) if cfg.apply_layernorm_1p else torch.ones(shape)
        std = cfg.init_method_std
        if cfg.scaled_output_init and name.endswith(("attention.dense.weight", "mlp.dense_4h_to_h.weight",
                                                              ".fc2.weight")):
            std = init_std_scaled(std, cfg.num_layers)
        gen = torch.Generator().manual_seed(param_seed(seed, name))
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            full = torch.zeros(shape)                    # padded vocab rows stay zero
            full[:cfg.vocab_size].normal_(0.0, std, generator=gen)
            return full
        return torch.empty(shape).normal_(0.0, std, generator=gen)

    # ------------------------------------------------------------------ ZeRO-3
    def zero3_plan(self) -> Zero3Plan:
        """The ZeRO-3 gather units of this chunk (:mod:`megazero.parallel.zero.units`).

        ``embedding`` (first stage), ``layers.<i>`` each, ``head`` (final norm + untied output layer;
        gathered by the final norm's forward and released when the chunk's forward ends, since the
        logits use the output weight after the norm). The tied word embedding is a unit of its own
        (``word_embeddings``) when the head uses it: on a chunk with both ends, both uses name it.
        """
        plan = Zero3Plan()
        tied_head = self.post_process and self.tied
        word = self.embedding.word_embeddings.weight if hasattr(self, "embedding") else None
        if tied_head:
            plan.units["word_embeddings"] = [("embedding.word_embeddings.weight", word)]
        if self.pre_process:
            rest = [(n, p) for n, p in trainable(self.embedding, "embedding.") if not (tied_head and p is word)]
            if rest:
                plan.units["embedding"] = rest
            names = (["embedding"] if rest else []) + (["word_embeddings"] if tied_head else [])
            plan.uses.append(UnitUse("embedding", self.embedding, self.embedding, names))
        for key, layer in self.layers.items():
            experts = getattr(layer.mlp, "experts", None)        # an MoE layer's experts: a unit of their own
            expert_ids = {id(p) for p in experts.parameters()} if experts is not None else set()
            plan.units[f"layers.{key}"] = [(n, p) for n, p in trainable(layer, f"layers.{key}.")
                                           if id(p) not in expert_ids]
            plan.uses.append(UnitUse(f"layers.{key}", layer, layer, [f"layers.{key}"]))
            if experts is not None:
                plan.units[f"layers.{key}.experts"] = trainable(experts, f"layers.{key}.mlp.experts.")
                plan.uses.append(UnitUse(f"layers.{key}.experts", experts, experts, [f"layers.{key}.experts"]))
        if self.post_process:
            head = trainable(self.final_norm, "final_norm.")
            if hasattr(self, "output_layer"):
                head += trainable(self.output_layer, "output_layer.")
            plan.units["head"] = head
            plan.uses.append(UnitUse("head", self.final_norm, self,
                                     ["head"] + (["word_embeddings"] if tied_head else [])))
        return plan

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, *,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        """See the class docstring. ``kv_cache`` (inference): the keys and values of the tokens before
        ``x`` (their count is the position of ``x``'s first token); this chunk's layers append to it."""
        offset = kv_cache.length if kv_cache is not None else 0
        h = self.embedding(x, offset) if self.pre_process else x
        if kv_cache is not None or not torch.is_grad_enabled():
            for key, layer in self.layers.items():
                h = layer(h, kv_cache.layer(int(key)) if kv_cache is not None else None)
        else:
            h = self._train_layers(h)
        if kv_cache is not None:
            kv_cache.advance(x.shape[1] if self.pre_process else h.shape[0])
        if not self.post_process:
            return h
        return self.output(h, labels)

    def output(self, h: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """The last stage's result from the layers' output ``h`` [s(/tp), b, h]: the final norm and the head,
        then the per-token loss [b, s] with ``labels``, else this rank's logits [b, s, V_pad/tp]."""
        h = self.final_norm(h)
        if labels is None:
            return self._logits(h).transpose(0, 1)                    # [b, s, V_pad/tp]
        return self.head_loss(h, labels)

    def head_loss(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The head's per-token loss [b, s] on normed hidden states ``h`` [s(/tp), b, h] against ``labels``
        [b, s] (fused with the cross-entropy under ``--cross-entropy-loss-fusion``)."""
        if self._fused_loss():
            return self._fused_cross_entropy(h, labels.t()).t()
        return vocab_parallel_cross_entropy(self._logits(h), labels.t(), self.tp_group).t()

    def _fused_loss(self) -> bool:
        """``--cross-entropy-loss-fusion`` where the head allows it (not an FP8 head)."""
        head_fp8 = self.head_fp8 if self.tied else self.output_layer.fp8
        return self.cfg.cross_entropy_loss_fusion and head_fp8 is None

    def _fused_cross_entropy(self, h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """[s(/tp), b, h] final hidden states, [s, b] targets -> per-token loss [s, b], the logits made a
        chunk of tokens at a time (:func:`megazero.parallel.tensor.vocab_parallel_linear_cross_entropy`).
        An untied head is called as a module, as in :meth:`_logits`, so its forward hooks run."""
        if self.tied:
            return vocab_parallel_linear_cross_entropy(h, self.embedding.word_embeddings.weight, target, self.tp_group,
                                                       vocab_size=self.cfg.vocab_size,
                                                       sequence_parallel=self.sequence_parallel)
        return self.output_layer(h, target, vocab_size=self.cfg.vocab_size)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """[s(/tp), b, h] -> this rank's [s, b, V_pad/tp] logits with padded entries at -inf (kept in
        the sequence-first layout: the matmul reads ``h`` as it is, no transposed copy either way).
        An untied head is called as a module, so its forward hooks run (``--overlap-param-gather``
        waits there for the head's all-gather)."""
        if self.tied:
            logits = column_parallel_linear(h, self.embedding.word_embeddings.weight, None, self.tp_group,
                                            sequence_parallel=self.sequence_parallel, fp8=self.head_fp8)
        else:
            logits = self.output_layer(h)
        return mask_padded_vocab(logits, self.cfg.vocab_size, self.ctx.tp_rank * logits.shape[-1], inplace=True)

    def fp8_layers(self, head: bool = False) -> list[FP8Layer]:
        """The linear layers this chunk could run in FP8 (:func:`megazero.parallel.fp8.enable`): every
        column- and row-parallel layer of the transformer layers and each expert's two, the output layer
        only with ``head`` (``--fp8-head``). Replicated key/value heads (fewer groups than tp ranks) are
        declared unsuitable: each rank's weight gradient there is a partial sum, which FP8 would round
        before the sum, unlike the serial run. The router stays in fp32."""
        ctx = self.ctx
        tokens = (ctx.cp.group,) if ctx.cp is not None else ()
        out = []
        for name, module in self.named_modules():
            if name == "output_layer" and not head:
                continue
            if isinstance(module, ColumnParallelLinear):
                out.append(FP8Layer(name, module, module.in_features, module.weight.shape[0],
                                    Splits.of(out_features=(ctx.tp_group,), tokens=tokens)))
            elif isinstance(module, RowParallelLinear):
                out.append(FP8Layer(name, module, module.weight.shape[1], module.out_features,
                                    Splits.of(in_features=(ctx.tp_group,), tokens=tokens)))
            elif isinstance(module, ReplicatedLinear):
                out.append(FP8Layer(name, module, 0, 0, Splits(), unsuitable="replicated key/value heads "
                                    "(fewer key/value groups than tp ranks): partial weight gradients"))
            elif isinstance(module, ExpertMLP):
                routed = tokens + ((ctx.tp_group,) if ctx.sp else ())     # each tp rank routes its own slice
                for fc in ("fc1", "fc2"):
                    w = getattr(module, fc).weight
                    out.append(FP8Layer(f"{name}.{fc}", getattr(module, fc), w.shape[1], w.shape[0],
                                        Splits.of(tokens=routed), expert=True))
        if head and self.post_process and self.tied:
            w = self.embedding.word_embeddings.weight
            out.append(FP8Layer("output_layer (tied to embedding.word_embeddings)", self, w.shape[1], w.shape[0],
                                Splits.of(out_features=(ctx.tp_group,), tokens=tokens), attr="head_fp8"))
        return out

    def _train_layers(self, h: torch.Tensor) -> torch.Tensor:
        """The layers' forward when autograd records: full recompute by groups (``--recompute-method``,
        :func:`megazero.spec.recompute.full_recompute_groups`), the first ``--cpu-offloading-num-layers``
        layers' saved tensors in host memory (:mod:`megazero.memory.activation_offload`)."""
        layers = list(self.layers.values())
        offload = self.activation_offload
        if offload is not None:
            offload.new_forward()

        def run(indices):
            def layers_forward(x):
                for i in indices:
                    if offload is not None and i < self.offloaded_layers:
                        with offload.layer(layers[i]):
                            x = layers[i](x)
                    else:
                        x = layers[i](x)
                return x
            return layers_forward

        cfg = self.cfg
        rng = self.rng if self.training and (cfg.attention_dropout > 0 or cfg.hidden_dropout > 0) else None
        for indices, recomputed in self.recompute_groups:
            h = checkpointed(run(indices), rng, h) if recomputed else run(indices)(h)
        return h

    masked_mean = staticmethod(masked_mean)


def activation_shape(model_cfg: GPTConfig, micro_batch_size: int, tp: int = 1,
                     sequence_parallel: bool = False, cp: int = 1) -> tuple[int, int, int]:
    """Shape of the tensor passed between pipeline stages: ``[s, b, h]``, or ``[s / tp, b, h]`` under
    sequence parallelism (each tp rank sends its own sequence chunk to the same tp rank of the next stage);
    ``s`` is a context-parallel rank's slice, ``seq_length / cp``."""
    seq = model_cfg.seq_length // cp
    if sequence_parallel and tp > 1:
        if seq % tp:
            raise ValueError(f"{FLAG.sequence_parallel} needs {FLAG.seq_length} {seq} divisible by tp {tp}")
        seq //= tp
    return (seq, micro_batch_size, model_cfg.hidden_size)
