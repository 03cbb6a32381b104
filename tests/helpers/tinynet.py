"""A tiny data-parallel test model and its single-process reference (tests of ZeRO 0-2, precision).

``TinyNet`` is a plain torch module (no tensor-parallel attributes): the ZeRO engine must work on any
module. ``reference_run`` trains it in one process with torch's AdamW; ``train_dp`` the same model
data-parallel through megazero's grad sync and optimizer, so a test compares the two.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from megazero.config import OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.parallel.zero import build_optimizer, wrap_data_parallel
from megazero.parallel.zero.adamw import weight_decay_groups

VOCAB, HIDDEN, SEQ = 32, 16, 8
OPT = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5)


class TinyNet(nn.Module):
    """Embedding -> (linear, layer norm, gelu, linear) residual -> untied head. ~2.6k parameters,
    with weights (decayed), biases and norm parameters (not decayed)."""

    def __init__(self, seed: int = 0, dtype=torch.float32, hidden: int = HIDDEN):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, hidden)
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.ln = nn.LayerNorm(2 * hidden)
        self.fc2 = nn.Linear(2 * hidden, hidden)
        self.head = nn.Linear(hidden, VOCAB, bias=False)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.to(dtype)

    def forward(self, tokens, labels):
        h = self.emb(tokens)  # [b, s, h]
        h = h + self.fc2(F.gelu(self.ln(self.fc1(h))))
        logits = self.head(h).float()
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.view(-1))


def make_batches(steps: int, global_batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (global_batch, SEQ), generator=g),
             torch.randint(0, VOCAB, (global_batch, SEQ), generator=g)) for _ in range(steps)]


def reference_run(steps: int, global_batch: int, opt_cfg: OptimizerConfig = OPT):
    """Single process, plain torch: AdamW (decay on >=2-D weights only) + clip_grad_norm_."""
    model = TinyNet()
    opt = torch.optim.AdamW(weight_decay_groups(model.named_parameters(), opt_cfg.weight_decay),
                            lr=opt_cfg.lr, betas=(opt_cfg.adam_beta1, opt_cfg.adam_beta2), eps=opt_cfg.adam_eps)
    losses, norms = [], []
    for tokens, labels in make_batches(steps, global_batch):
        loss = model(tokens, labels)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.clip_grad)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def train_dp(topo, stage: int, steps: int, global_batch: int, micro_batches: int, bucket_size: int = 300,
             dtype=torch.float32, precision: PrecisionConfig | None = None, model=None, hidden: int = HIDDEN,
             overlap: bool = True, start: int = 0, opt_state: dict | None = None, grad_sync_cls=None,
             each_microbatch: bool = False):
    """Train TinyNet data-parallel; returns (global losses, norms, params, grad_sync, optimizer)."""
    model = model or TinyNet(dtype=dtype, hidden=hidden)
    sync = wrap_data_parallel(model, topo, ZeroConfig(zero_stage=stage, bucket_size=bucket_size,
                                                      overlap_grad_reduce=overlap,
                                                      reduce_each_microbatch=each_microbatch),
                              grad_sync_cls=grad_sync_cls)
    opt = build_optimizer(sync, OPT, precision)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    per_rank = global_batch // topo.dp_size
    mb = per_rank // micro_batches
    losses, norms = [], []
    for tokens, labels in make_batches(start + steps, global_batch)[start:]:
        lo = topo.dp_rank * per_rank
        local = 0.0
        opt.zero_grad()                 # at the start of a step, like megazero.training
        sync.comm_log.reset()
        for m in range(micro_batches):
            sl = slice(lo + m * mb, lo + (m + 1) * mb)
            sync.before_backward(0, m == micro_batches - 1)
            loss = model(tokens[sl], labels[sl])
            (loss * opt.loss_scale / micro_batches).backward()
            local += loss.item() / micro_batches
        sync.finalize_grads()
        norm, _ = opt.step()
        t = torch.tensor([local])
        torch.distributed.all_reduce(t, group=topo.dp_group)
        losses.append(t.item() / topo.dp_size)
        norms.append(norm)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, norms, params, sync, opt
