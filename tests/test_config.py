"""Every invalid layout or shape is rejected by validate() with a message naming the flag, every
flag a message names is one the command line takes, and no message outside megazero/config/ spells a
flag by hand."""
import ast
import re
from pathlib import Path

import pytest

from megazero.cli.arguments import build_parser
from megazero.config import (
    CheckpointConfig,
    DataConfig,
    JobConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainConfig,
    ZeroConfig,
    flag,
    flag_fields,
    setting,
    validate,
)
from megazero.config.train import batch_size_at, parse_batch_size_schedule
from megazero.errors import ConfigError
from megazero.models.gpt import GPTConfig


def job(**sections) -> JobConfig:
    j = JobConfig()
    for name, value in sections.items():
        setattr(j, name, value)
    return j


def test_valid_layout_fills_derived_values():
    j = validate(job(model=GPTConfig(num_layers=8), parallel=ParallelConfig(tp=2, pp=2,
                 num_layers_per_virtual_pipeline_stage=2), train=TrainConfig(micro_batch_size=2,
                 global_batch_size=16)), world_size=8)
    assert j.parallel.dp == 2 and j.parallel.virtual_stages == 2
    assert j.parallel.pipeline_schedule == "interleaved"
    assert j.num_micro_batches == 4
    assert j.optimizer.lr_decay_iters == j.train.train_iters


def test_zb_v_implies_two_chunks_per_rank():
    for per_virtual in (None, 2):               # unset, or the value that says the same
        j = validate(job(model=GPTConfig(num_layers=8), parallel=ParallelConfig(
            pp=2, pipeline_schedule="zb-v", num_layers_per_virtual_pipeline_stage=per_virtual)), world_size=2)
        assert j.parallel.virtual_stages == 2 and j.parallel.pipeline_schedule == "zb-v"


def test_the_context_parallel_comm_type_is_filled_only_where_it_means_something():
    """Left out, --cp-comm-type is p2p at cp above 1 and stays unset at cp 1 (where giving it is refused), so a
    validated job validates again; a count of layers up to a chunk's is kept."""
    j = validate(job(parallel=ParallelConfig(cp=2), model=GPTConfig(seq_length=16)), world_size=2)
    assert j.parallel.cp_comm_type == "p2p" and validate(j, 2).parallel.cp_comm_type == "p2p"
    j = validate(job(), world_size=1)
    assert j.parallel.cp_comm_type is None and validate(j, 1).parallel.cp_comm_type is None
    j = validate(job(parallel=ParallelConfig(pp=2), model=GPTConfig(num_layers=4, cpu_offloading=True,
                                                                      cpu_offloading_num_layers=2)), world_size=2)
    assert j.model.cpu_offloading_num_layers == 2


def test_nvme_offload_with_expert_parallelism_is_accepted():
    """docs/memory.md: with experts split over ep 2, optimizer state and parameters offload to nvme too."""
    j = validate(job(model=GPTConfig(num_experts=4), parallel=ParallelConfig(expert_model_parallel_size=2),
                     zero=ZeroConfig(zero_stage=3, offload_optimizer="nvme", offload_params="nvme", nvme_path="."),
                     train=TrainConfig(micro_batch_size=1, global_batch_size=2)), world_size=2)
    assert j.parallel.expert_model_parallel_size == 2 and j.zero.offload_params == "nvme"


def test_validate_does_not_mutate_its_input():
    original = job(parallel=ParallelConfig(tp=2))
    validate(original, world_size=4)
    assert original.parallel.dp is None and original.train.global_batch_size is None


def test_padded_vocab_is_a_multiple_of_divisor_times_tp():
    m = GPTConfig(vocab_size=50257)
    assert m.padded_vocab_size(1) == 50304 and m.padded_vocab_size(4) == 50688
    assert GPTConfig(vocab_size=50257, make_vocab_size_divisible_by=1).padded_vocab_size(3) == 50259


@pytest.mark.parametrize("world,sections,pattern", [
    (3, dict(parallel=ParallelConfig(tp=2)), r"world size 3 is not divisible by tp\*pp = 2\*1 = 2"),
    (1, dict(checkpoint=CheckpointConfig(save_interval=10)), r"--save-interval needs --save"),
    (1, dict(checkpoint=CheckpointConfig(finetune=True)), r"--finetune needs --load"),
    (8, dict(parallel=ParallelConfig(tp=2, pp=2, dp=4)), r"does not equal the world size 8.*--dp"),
    (2, dict(parallel=ParallelConfig(tp=2), model=GPTConfig(num_attention_heads=3, hidden_size=48)),
     r"--num-attention-heads 3 is not divisible by --tensor-model-parallel-size/--tp 2"),
    (2, dict(parallel=ParallelConfig(tp=2), model=GPTConfig(ffn_hidden_size=129)),
     r"--ffn-hidden-size 129 is not divisible by --tensor-model-parallel-size/--tp 2"),
    (3, dict(parallel=ParallelConfig(tp=3), model=GPTConfig(num_attention_heads=3, hidden_size=48,
                                                              ffn_hidden_size=96)), None),
    (2, dict(parallel=ParallelConfig(pp=2), model=GPTConfig(num_layers=3)),
     r"--num-layers 3 is not divisible by --pipeline-model-parallel-size/--pp 2"),
    (2, dict(parallel=ParallelConfig(pp=2, num_layers_per_virtual_pipeline_stage=3),
             model=GPTConfig(num_layers=8)), r"--num-layers 8 is not divisible by .*virtual-pipeline-stage 3"),
    (2, dict(parallel=ParallelConfig(pp=2, num_layers_per_virtual_pipeline_stage=2),
             model=GPTConfig(num_layers=4)), r"gives one chunk per rank"),
    (4, dict(train=TrainConfig(micro_batch_size=3, global_batch_size=16)),
     r"--global-batch-size 16 is not divisible by --micro-batch-size 3 \* dp 4 = 12"),
    (4, dict(parallel=ParallelConfig(pp=4), model=GPTConfig(num_layers=4),
             train=TrainConfig(micro_batch_size=1, global_batch_size=2)),
     r"2 micro-batches per step is fewer than 4 pipeline stages.*--global-batch-size to at least 4"),
    (2, dict(parallel=ParallelConfig(pp=2, num_layers_per_virtual_pipeline_stage=1), model=GPTConfig(num_layers=4),
             train=TrainConfig(micro_batch_size=1, global_batch_size=3)), r"interleaved schedule needs micro-batches \(3\)"),
    (2, dict(parallel=ParallelConfig(pp=2, pipeline_schedule="zb-h1", num_layers_per_virtual_pipeline_stage=1),
             model=GPTConfig(num_layers=4)), r"--pipeline-schedule zb-h1 runs one model chunk per rank: drop"),
    (2, dict(parallel=ParallelConfig(pp=2, pipeline_schedule="zb-v"), model=GPTConfig(num_layers=6)),
     r"--pipeline-schedule zb-v puts two chunks on each of the 2 pipeline ranks: --num-layers 6 must be divisible"),
    (2, dict(parallel=ParallelConfig(pp=2, pipeline_schedule="zb-v", num_layers_per_virtual_pipeline_stage=1),
             model=GPTConfig(num_layers=8)), r"zb-v runs two chunks per rank \(2 layers each\).*drop --num-layers-per"),
    (4, dict(parallel=ParallelConfig(pp=4, pipeline_schedule="zb-v"), model=GPTConfig(num_layers=8),
             train=TrainConfig(micro_batch_size=1, global_batch_size=2)),
     r"2 micro-batches per step is fewer than 4 pipeline stages, which leaves the zb-v pipeline"),
    (2, dict(parallel=ParallelConfig(pp=2, pipeline_schedule="gpipe", num_layers_per_virtual_pipeline_stage=1),
             model=GPTConfig(num_layers=4)),
     r"--pipeline-schedule gpipe runs one model chunk per rank: drop --num-layers-per-virtual-pipeline-stage, or use "
     r"a schedule with virtual stages \(interleaved or zb-v\)"),
    (1, dict(parallel=ParallelConfig(pipeline_schedule="zb-h1")),
     r"--pipeline-schedule zb-h1 is a zero-bubble pipeline schedule and does nothing at --pipeline-model-parallel-"
     r"size/--pp 1: drop it, or use --pipeline-model-parallel-size/--pp 2 or more"),
    (1, dict(parallel=ParallelConfig(pipeline_schedule="zb-v")), r"--pipeline-schedule zb-v is a zero-bubble"),
    (1, dict(parallel=ParallelConfig(cp_comm_type="a2a")),
     r"--cp-comm-type a2a chooses how context-parallel ranks share keys and values and does nothing at "
     r"--context-parallel-size/--cp 1: drop it"),
    (1, dict(parallel=ParallelConfig(cp_comm_type="p2p")), r"--cp-comm-type p2p chooses how"),
    (2, dict(parallel=ParallelConfig(pp=2), model=GPTConfig(num_layers=4, cpu_offloading=True,
                                                              cpu_offloading_num_layers=3)),
     r"--cpu-offloading-num-layers 3 counts layers of each model chunk, which holds 2 \(--num-layers 4 over "
     r"--pipeline-model-parallel-size/--pp 2\): use at most 2"),
    (2, dict(parallel=ParallelConfig(pp=2), model=GPTConfig(num_layers=4, recompute_granularity="full",
                                                              recompute_method="block", recompute_num_layers=3)),
     r"--recompute-num-layers 3 counts layers of each model chunk, which holds 2"),
    (2, dict(parallel=ParallelConfig(pp=2, num_layers_per_virtual_pipeline_stage=2),
             model=GPTConfig(num_layers=8, recompute_granularity="full", recompute_method="uniform",
                             recompute_num_layers=4)),
     r"--recompute-num-layers 4 counts layers of each model chunk, which holds 2 \(--num-layers 8 over "
     r"--pipeline-model-parallel-size/--pp 2 x 2 virtual stages\): use at most 2"),
    (1, dict(model=GPTConfig(num_layers=4, recompute_granularity="full", recompute_method="block",
                             recompute_num_layers=0)), r"--recompute-num-layers must be a positive integer, got 0"),
    (1, dict(zero=ZeroConfig(zero_stage=4)), r"--zero-stage must be 0, 1, 2 or 3, got 4"),
    (2, dict(zero=ZeroConfig(zero_stage=1, reduce_each_microbatch=True)),
     r"--zero2-reduce-each-microbatch applies to --zero-stage 2 only \(got 1\)"),
    (2, dict(zero=ZeroConfig(zero_stage=3, overlap_param_gather=True)),
     r"--overlap-param-gather applies to --zero-stage 1 and 2 \(got 3"),
    (2, dict(zero=ZeroConfig(zero_stage=2, keep_params_gathered=True)),
     r"--zero3-keep-params-gathered applies to --zero-stage 3 only \(got 2\)"),
    (1, dict(precision=PrecisionConfig(bf16=True, fp16=True)), r"--bf16 and --fp16 are exclusive"),
    (2, dict(parallel=ParallelConfig(tp=2, sequence_parallel=True), model=GPTConfig(seq_length=33,
                                                                                      max_position_embeddings=64)),
     r"--sequence-parallel needs --seq-length \(33\) divisible"),
    (1, dict(model=GPTConfig(seq_length=128, max_position_embeddings=64)), r"--max-position-embeddings 64"),
    (1, dict(model=GPTConfig(hidden_size=65)), r"--hidden-size 65 is not divisible by --num-attention-heads"),
    (1, dict(optimizer=OptimizerConfig(lr_decay_style="step")), r"--lr-decay-style must be one of"),
    (1, dict(optimizer=OptimizerConfig(lr=1e-4, min_lr=1e-3)), r"--min-lr"),
    (1, dict(optimizer=OptimizerConfig(decoupled_min_lr=1e-5)),
     r"^--decoupled-min-lr needs --decoupled-lr \(the peak it decays from\): add it, or drop --decoupled-min-lr"),
    (1, dict(optimizer=OptimizerConfig(decoupled_lr=0.0)), r"and --decoupled-lr > 0 \(--decoupled-min-lr defaults"),
    (1, dict(optimizer=OptimizerConfig(decoupled_lr=1e-4, decoupled_min_lr=1e-3)),
     r"^need 0 <= --decoupled-min-lr \(0.001\) <= --decoupled-lr \(0.0001\)"),
    (1, dict(optimizer=OptimizerConfig(min_lr=1e-3, decoupled_lr=1e-4)), r"--decoupled-min-lr \(0.001\) <= "),
    (1, dict(data=DataConfig(split="a,b")), r"--split 'a,b'"),
    (1, dict(data=DataConfig(mock_data=True, data_path=["x"])), r"--mock-data and --data-path are exclusive"),
    (1, dict(data=DataConfig(data_path=["0.3", "a", "b"])), r"weight-prefix pairs"),
    (1, dict(data=DataConfig(tokenizer_type="GPT2BPETokenizer")), r"needs --vocab-file and --merge-file"),
    (1, dict(model=GPTConfig(num_layers=0)), r"--num-layers must be a positive integer"),
    (1, dict(model=GPTConfig(hidden_dropout=1.0)), r"--hidden-dropout must be in \[0, 1\)"),
    (4, dict(model=GPTConfig(num_experts=6), parallel=ParallelConfig(expert_model_parallel_size=4)),
     r"--num-experts 6 is not divisible by --expert-model-parallel-size 4"),
    (6, dict(model=GPTConfig(num_experts=4), parallel=ParallelConfig(expert_model_parallel_size=4)),
     r"data-parallel size 6 is not divisible by --expert-model-parallel-size 4"),
    (1, dict(model=GPTConfig(num_experts=2, moe_router_topk=3)), r"--moe-router-topk 3 exceeds --num-experts 2"),
    (2, dict(parallel=ParallelConfig(expert_model_parallel_size=2)),
     r"--expert-model-parallel-size 2 needs --num-experts"),
    (1, dict(model=GPTConfig(num_experts=4, moe_expert_capacity_factor=0.0)),
     r"--moe-expert-capacity-factor must be > 0"),
    (1, dict(model=GPTConfig(num_experts=4, moe_aux_loss_coeff=-1.0)), r"--moe-aux-loss-coeff must be >= 0"),
    (1, dict(model=GPTConfig(num_experts=4, moe_layer_freq=0)), r"--moe-layer-freq must be a positive integer"),
    (1, dict(train=TrainConfig(step_batch_size_schedule="0:8 x:16")),
     r"^--step-batch-size-schedule entry 'x:16' is not THRESHOLD:BATCH \(numbers, K/M/B/T suffixes allowed\)$"),
    (1, dict(train=TrainConfig(step_batch_size_schedule="1K:8 2K:16")),
     r"^--step-batch-size-schedule entry '1K:8': the first threshold must be 0 \(the batch the run starts at\)$"),
    (1, dict(train=TrainConfig(step_batch_size_schedule="0:8 64K:16 32K:32")),
     r"^--step-batch-size-schedule entry '32K:32': thresholds must increase \(\d+ samples is not past \d+\)$"),
    (1, dict(train=TrainConfig(step_batch_size_schedule="0:8 1K:0")), r"entry '1K:0': the threshold must be >= 0 "),
    (2, dict(train=TrainConfig(micro_batch_size=2, step_batch_size_schedule="0:4 1M:6 2M:8")),
     r"^--step-batch-size-schedule entry '1M:6': batch 6 is not divisible by --micro-batch-size 2 \* dp 2 "
     r"= 4: use a multiple of 4$"),
    (2, dict(train=TrainConfig(micro_batch_size=1, step_batch_size_schedule="0:2 1M:4"),
             parallel=ParallelConfig(pp=2, num_layers_per_virtual_pipeline_stage=1),
             model=GPTConfig(num_layers=4)),
     None),
    (2, dict(train=TrainConfig(micro_batch_size=1, step_batch_size_schedule="0:2 1M:3"),
             parallel=ParallelConfig(pp=2, num_layers_per_virtual_pipeline_stage=1),
             model=GPTConfig(num_layers=4)),
     r"^--step-batch-size-schedule entry '1M:3': batch 3: the interleaved schedule needs micro-batches \(3\) "
     r"divisible by --pipeline-model-parallel-size/--pp 2: make that batch a multiple of 2$"),
    (1, dict(train=TrainConfig(global_batch_size=8, step_batch_size_schedule="0:8 1M:16")),
     r"^--global-batch-size 8 is not the last batch of --step-batch-size-schedule \(16\): drop --global-batch-size "
     r"or make it 16$"),
    (1, dict(train=TrainConfig(gradient_accumulation_steps=2, step_batch_size_schedule="0:8 1M:16")),
     r"^--step-batch-size-schedule sets the global batch step by step; a gradient accumulation count fixes it"),
])
def test_invalid_configs_name_the_flag(world, sections, pattern):
    if pattern is None:  # a valid odd-sized layout: padded vocab stays divisible by tp
        assert validate(job(**sections), world).model.padded_vocab_size(3) % 3 == 0
        return
    with pytest.raises(ConfigError, match=pattern):
        validate(job(**sections), world)


def test_a_batch_size_schedule_reads_megatrons_suffixes_and_token_thresholds():
    """Megatron-LM's own example: "0:16 2.4B:320 ... 12B:1536" in tokens at seq 2048 is 1,171,875 samples a step."""
    schedule = parse_batch_size_schedule("0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536", 2048)
    assert schedule == ((0, 16), (1171875, 320), (2343750, 624), (3515625, 928), (4687500, 1232), (5859375, 1536))
    assert parse_batch_size_schedule("0:1 1.5k:2,2M:3 1T:4", None) == ((0, 1), (1500, 2), (2000000, 3), (10**12, 4))
    assert [batch_size_at(schedule, c) for c in (0, 1171874, 1171875, 2343749, 10**9)] == [16, 16, 320, 320, 1536]


def test_a_batch_size_schedule_fills_the_global_batch_train_samples_and_lr_position():
    """The last batch is the global batch (the estimator's and the dataset's size); --train-samples counts the steps
    that consume them as Megatron-LM does; the LR schedule moves by samples in units of the full batch."""
    j = validate(job(train=TrainConfig(micro_batch_size=1, step_batch_size_schedule="0:2 64:4", train_samples=11),
                     model=GPTConfig(seq_length=16, max_position_embeddings=16)), 1)
    t = j.train
    assert (t.global_batch_size, t.batch_schedule, t.train_iters) == (4, ((0, 2), (4, 4)), 4)   # 2, 2, 4, 4
    assert [t.global_batch_at(c) for c in (0, 2, 4, 8)] == [2, 2, 4, 4]
    assert [t.lr_position(i, c) for i, c in ((0, 0), (1, 2), (2, 4), (3, 8))] == [-0.5, 0.0, 1.0, 2.0]
    assert j.num_micro_batches == 4                                 # the largest batch's, for the estimate
    peak_first = validate(job(train=TrainConfig(micro_batch_size=1, step_batch_size_schedule="0:8 64:4"),
                              model=GPTConfig(seq_length=16, max_position_embeddings=16)), 1)
    assert (peak_first.train.global_batch_size, peak_first.num_micro_batches) == (4, 8)
    constant = validate(job(train=TrainConfig(micro_batch_size=1, global_batch_size=4)), 1).train
    assert constant.lr_position(3, 12) == 3 and constant.global_batch_at(12) == 4


def test_decoupled_min_lr_defaults_to_min_lr_and_a_resume_compares_both():
    """As Megatron-LM: --decoupled-min-lr not given is --min-lr; the checkpoint holds the resolved pair, and a
    resume that changes or adds them is refused like one that changes --lr."""
    opt = validate(job(optimizer=OptimizerConfig(min_lr=1e-5, decoupled_lr=5e-4)), 1).optimizer
    assert (opt.decoupled_lr, opt.decoupled_min_lr) == (5e-4, 1e-5)
    assert validate(job(), 1).optimizer.decoupled_min_lr is None
    saved = {"optimizer": {"lr": opt.lr, "min_lr": 1e-5, "decoupled_lr": None, "decoupled_min_lr": None}}
    with pytest.raises(ConfigError, match=r"another schedule \(--decoupled-lr: checkpoint None vs this run 0.0005; "
                                          r"--decoupled-min-lr: checkpoint None vs this run 1e-05\)"):
        CheckpointConfig().resumed_schedule(saved, TrainConfig(), opt, "the checkpoint in x")


def test_padded_vocab_always_divisible_by_tp():
    # The divisor is multiplied by tp, so the check can only fail if the rule itself breaks.
    for tp in (1, 2, 3, 4, 8):
        for div in (1, 7, 128):
            assert GPTConfig(vocab_size=1001, make_vocab_size_divisible_by=div).padded_vocab_size(tp) % tp == 0


def test_every_flag_names_a_parser_option_of_its_own_field():
    options = build_parser()._option_string_actions
    fields = list(flag_fields())
    assert len(fields) > 90
    for section, f, _ in fields:
        for spelling in flag(f.name).split("/"):
            assert spelling in options, f"flag({f.name!r}) gives {spelling}, which the parser does not take"
            assert options[spelling].dest == f"{section}.{f.name}", f"{spelling} sets {options[spelling].dest}"


@pytest.mark.parametrize("name,spelling", [
    ("order", "--parallel-order"), ("prefetch_layers", "--zero3-prefetch-layers"),
    ("keep_params_gathered", "--zero3-keep-params-gathered"),
    ("reduce_each_microbatch", "--zero2-reduce-each-microbatch"),
    ("quantized_weights", "--zero-quantized-weights"), ("quantization_block_size", "--zero-quantization-block-size"),
    ("hpz_partition_size", "--zero-hpz-partition-size"), ("quantized_gradients", "--zero-quantized-gradients"),
])
def test_fields_named_unlike_their_flag_give_the_real_flag(name, spelling):
    # flag() once spelled these "--" + the field name ("--order", "--prefetch-layers", ...): no such options.
    assert flag(name) == spelling and spelling in build_parser()._option_string_actions


def test_flag_shows_short_aliases_only_and_refuses_non_flags():
    assert flag("tp") == "--tensor-model-parallel-size/--tp"
    assert flag("add_bias_linear") == "--disable-bias-linear"
    assert flag("layernorm_epsilon") == "--norm-epsilon"       # its longer alias --layernorm-epsilon is not shown
    for name in ("virtual_stages", "gradient_accumulation_steps", "no_such_field"):
        with pytest.raises(KeyError):
            flag(name)
    assert setting("gradient_accumulation_steps") == "gradient_accumulation_steps" and setting("tp") == flag("tp")


PACKAGE = Path(__file__).resolve().parents[1] / "megazero"
SPELLING = re.compile(r"--[a-z][a-z0-9-]*")
DECLARING_CALLS = ("flag_field", "add_argument")      # their positional strings declare a flag's spellings
DECLARING_TABLES = ("OTHER_OPTIONS",)                 # the parser's options that are no config field


def _not_messages(tree: ast.Module) -> set[int]:
    """ids of the string constants of ``tree`` that are no message: docstrings, the spellings given to
    ``flag_field(...)`` / ``add_argument(...)``, and the OTHER_OPTIONS table."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                skip.add(id(first.value))
        elif isinstance(node, ast.Call):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if called in DECLARING_CALLS:
                skip |= {id(arg) for arg in node.args if isinstance(arg, ast.Constant)}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if node.value is not None and any(getattr(t, "id", None) in DECLARING_TABLES for t in targets):
                skip |= {id(n) for n in ast.walk(node.value)}
    return skip


def hand_spelled_flags(paths, spellings: set[str]) -> list[str]:
    """``"file:line: --flag"`` for every string constant of ``paths`` (f-string parts included) that spells
    one of ``spellings`` by hand instead of through ``flag()`` / ``FLAG``."""
    found = []
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = _not_messages(tree)
        where = path.relative_to(PACKAGE.parent) if path.is_relative_to(PACKAGE.parent) else path.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
                found += [f"{where}:{node.lineno}: {s}" for s in SPELLING.findall(node.value) if s in spellings]
    return sorted(found)


def every_flag_spelling() -> set[str]:
    """Every spelling of every flag, a ``--no-x`` of a ``--x`` / ``--no-x`` pair included."""
    return {s for _, _, meta in flag_fields() for s in meta.spellings + meta.negations}


def test_no_message_outside_config_spells_a_flag_by_hand():
    """A message names a flag through ``flag()`` / ``FLAG``, so renaming the flag renames it everywhere;
    megazero/config/ declares the flags, and a model family's config class its own."""
    paths = [p for p in sorted(PACKAGE.rglob("*.py")) if not p.is_relative_to(PACKAGE / "config")]
    assert len(paths) > 100
    assert not hand_spelled_flags(paths, every_flag_spelling())


def test_the_hand_spelled_flag_rule_can_fail(tmp_path):
    bad, good = tmp_path / "bad.py", tmp_path / "good.py"
    bad.write_text('def check(n):\n'
                   '    """Refuse --num-layers below 1 (a docstring documents)."""\n'
                   '    if n < 1:\n'
                   '        raise ValueError("--num-layers must be positive")\n'
                   '    return f"--hidden-size {n}"\n')
    good.write_text('def check(n):\n'
                    '    if n < 1:\n'
                    '        raise ValueError(f"{flag(\'num_layers\')} must be positive")\n'
                    'layers = flag_field(1, "--num-layers", group="model", help="transformer layers")\n')
    spellings = every_flag_spelling()
    assert hand_spelled_flags([bad], spellings) == ["bad.py:4: --num-layers", "bad.py:5: --hidden-size"]
    assert hand_spelled_flags([good], spellings) == []


def test_model_family_must_be_a_name():
    assert validate(JobConfig(), 1).model.model_family == "gpt"
    with pytest.raises(ConfigError, match=r"--model-family must name a model family, got ''"):
        validate(job(model=GPTConfig(model_family="")), 1)


def test_a_section_checks_itself():
    """A section's rules are its own ``check`` (what validate() runs for it), usable alone."""
    ZeroConfig(zero_stage=3, hpz_partition_size=2).check(ParallelConfig(dp=4), world_size=4)
    with pytest.raises(ConfigError, match=r"--zero-hpz-partition-size 3 must divide the data-parallel size 4"):
        ZeroConfig(zero_stage=3, hpz_partition_size=3).check(ParallelConfig(dp=4), world_size=4)
    with pytest.raises(ConfigError, match=r"--zero3-keep-params-gathered applies to --zero-stage 3 only"):
        ZeroConfig(zero_stage=2, keep_params_gathered=True).check(ParallelConfig(dp=2), world_size=2)


def test_an_hpz_partition_stays_inside_a_node(monkeypatch):
    """hpZ's secondary partitions are K consecutive dp ranks; one that spans nodes is refused (its
    backward gathers would cross the slow link), whatever tells the node size (--ranks-per-node or
    torchrun's LOCAL_WORLD_SIZE)."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    z = ZeroConfig(zero_stage=3, hpz_partition_size=4)
    z.check(ParallelConfig(dp=8, ranks_per_node=4), world_size=8)                   # nodes of 4 dp ranks
    with pytest.raises(ConfigError, match=r"--zero-hpz-partition-size 4 puts ranks \[0, 1, 2, 3\] of nodes of 2 "
                                          r"ranks in one secondary partition, which spans nodes"):
        z.check(ParallelConfig(dp=8, ranks_per_node=2), world_size=8)
    with pytest.raises(ConfigError, match="spans nodes"):                           # tp 2: dp ranks 2 apart
        z.check(ParallelConfig(tp=2, dp=4, ranks_per_node=4), world_size=8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="of nodes of 2 ranks"):
        z.check(ParallelConfig(dp=8), world_size=8)


def test_a_family_registered_outside_its_package_is_not_built_in():
    """A spec registered under a new name with a built-in family's config class (a test's, a user's) is not one of
    megazero's own families: the fuzzer draws built-in families only."""
    from megazero.config.model import builtin_families
    from megazero.spec import ModelSpec, get_model_spec, register_model_spec

    gpt = get_model_spec("gpt")
    register_model_spec(ModelSpec("registered-elsewhere-test", gpt.config, gpt.build_chunk, gpt.boundary_shape,
                                  gpt.loss, gpt.flops_per_token))
    names = [entry.name for entry in builtin_families()]
    assert "gpt" in names and len(names) >= 2 and "registered-elsewhere-test" not in names
