"""DeepSpeed JSON and Accelerate YAML configs: each key lands on its flag, "auto" defers to the
flags, an unsupported key is refused by its path, and a run configured either way trains exactly
like the same run configured by flags."""
from __future__ import annotations

import json
import math

import pytest
from helpers import run_on_ranks
from helpers.trainer import main_body, read_metrics

from megazero.cli.job import parse_job
from megazero.errors import ConfigError
from megazero.foreign_config import Launch, from_accelerate, from_deepspeed

# The model and run length; batch, optimizer, schedule and precision come from each config below.
BASE = ["--mock-data", "--vocab-size", "100", "--make-vocab-size-divisible-by", "16", "--num-layers", "2",
        "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--train-iters", "4",
        "--log-interval", "1", "--eval-interval", "4", "--eval-iters", "1", "--seed", "7"]

DEEPSPEED = {
    "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.5, "bf16": {"enabled": True}, "steps_per_print": 10,
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 5000, "overlap_comm": True, "contiguous_gradients": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "eps": 1e-7, "weight_decay": 0.05}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 2, "total_num_steps": 4,
                                                       "cos_min_ratio": 0.5, "warmup_type": "linear"}},
}
# The same run in flags (dp 2 from the world size: 8 = 2 x 2 micro-batches x dp 2)
FLAGS = ["--global-batch-size", "8", "--micro-batch-size", "2", "--clip-grad", "0.5", "--bf16", "--zero-stage", "2",
         "--bucket-size", "5000", "--overlap-grad-reduce", "--lr", "2e-3", "--adam-beta1", "0.9", "--adam-beta2",
         "0.95", "--adam-eps", "1e-7", "--weight-decay", "0.05", "--lr-warmup-iters", "2", "--lr-decay-iters", "4",
         "--lr-decay-style", "cosine", "--min-lr", "1e-3"]

ACCELERATE = """\
compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
mixed_precision: bf16
num_processes: 2
deepspeed_config:
  zero_stage: 2
  gradient_accumulation_steps: 2
  gradient_clipping: 0.5
  zero3_init_flag: true
  offload_optimizer_device: none
  offload_param_device: none
  deepspeed_config_file: ds.json
"""


@pytest.fixture
def configs(tmp_path):
    """ds_config.json (everything), and an Accelerate YAML whose deepspeed_config_file holds the
    batch, optimizer and schedule (the rest is in the YAML)."""
    (tmp_path / "ds_config.json").write_text(json.dumps(DEEPSPEED))
    inner = {k: v for k, v in DEEPSPEED.items() if k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                         "optimizer", "scheduler", "zero_optimization")}
    (tmp_path / "ds.json").write_text(json.dumps({**inner, "gradient_accumulation_steps": "auto"}))
    (tmp_path / "accelerate.yaml").write_text(ACCELERATE)
    return tmp_path / "ds_config.json", tmp_path / "accelerate.yaml"


def _settings(job):
    """What a run does, without the fields only a config file sets (accumulation steps, min-lr ratio:
    they fill the fields the flags set directly; what the file resolved, reported)."""
    out = {section: vars(getattr(job, section)).copy() for section in vars(job)}
    out["train"].pop("gradient_accumulation_steps")
    out["optimizer"].pop("min_lr_ratio")
    out["logging"].pop("config_files")
    return out


def test_deepspeed_keys_land_on_their_flags(configs):
    ds, _ = configs
    assert from_deepspeed(ds) == {
        "train.global_batch_size": 8, "train.micro_batch_size": 2, "train.gradient_accumulation_steps": 2,
        "optimizer.clip_grad": 0.5, "precision.bf16": True, "zero.zero_stage": 2, "zero.bucket_size": 5000,
        "zero.overlap_grad_reduce": True, "optimizer.lr": 2e-3, "optimizer.adam_beta1": 0.9,
        "optimizer.adam_beta2": 0.95, "optimizer.adam_eps": 1e-7, "optimizer.weight_decay": 0.05,
        "optimizer.lr_warmup_iters": 2, "optimizer.lr_decay_style": "cosine", "optimizer.lr_decay_iters": 4,
        "optimizer.min_lr_ratio": 0.5, "optimizer.lr_warmup_style": "linear"}
    from_ds = parse_job([*BASE, "--deepspeed-config", str(ds)], 2)[0]
    from_flags = parse_job([*BASE, *FLAGS], 2)[0]
    assert _settings(from_ds) == _settings(from_flags)


def test_accelerate_keys_land_on_their_flags(configs):
    _, acc = configs
    got = from_accelerate(acc)
    assert got["precision.bf16"] is True and got["zero.sharded_init"] is True
    assert got["train.gradient_accumulation_steps"] == 2 and got["optimizer.clip_grad"] == 0.5
    from_acc = parse_job([*BASE, "--accelerate-config", str(acc)], 2)[0]
    assert _settings(from_acc) == _settings(parse_job([*BASE, *FLAGS, "--sharded-init"], 2)[0])


def test_offload_keys_land_on_their_flags(tmp_path):
    """DeepSpeed's offload_optimizer / offload_param sections and Accelerate's offload_*_device keys."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {
        "stage": 3, "sub_group_size": 1e6,
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": False},
        "offload_param": {"device": "cpu", "pin_memory": False}}}))
    flags = ["--zero-stage", "3", "--offload-optimizer", "nvme", "--offload-params", "cpu", "--nvme-path",
             str(tmp_path), "--no-offload-pin-memory", "--offload-sub-group-size", "1000000"]
    assert _settings(parse_job([*BASE, "--deepspeed-config", str(ds)], 2)[0]) == \
        _settings(parse_job([*BASE, *flags], 2)[0])
    acc = tmp_path / "default_config.yaml"
    acc.write_text(f"deepspeed_config:\n  zero_stage: 3\n  offload_optimizer_device: cpu\n"
                   f"  offload_param_device: nvme\n  offload_param_nvme_path: {tmp_path}\n")
    assert from_accelerate(acc) == {"zero.zero_stage": 3, "zero.offload_optimizer": "cpu",
                                    "zero.offload_params": "nvme", "zero.nvme_path": str(tmp_path)}


def test_auto_defers_to_the_flags_and_flags_may_repeat_but_not_contradict(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
                                "optimizer": {"type": "Adam", "params": {"lr": "auto", "weight_decay": 0.1}},
                                "fp16": {"enabled": "auto"}}))
    job = parse_job([*BASE, "--deepspeed-config", str(path), "--micro-batch-size", "4", "--clip-grad", "2",
                     "--lr", "5e-4", "--weight-decay", "0.1"], 1)[0]
    assert (job.train.micro_batch_size, job.optimizer.clip_grad, job.optimizer.lr) == (4, 2.0, 5e-4)
    assert job.optimizer.weight_decay == 0.1 and not job.precision.fp16
    with pytest.raises(SystemExit):
        parse_job([*BASE, "--deepspeed-config", str(path), "--weight-decay", "0.2"], 1)


@pytest.mark.parametrize("config,path", [
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
     "zero_optimization.offload_optimizer.ratio"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "gpu"}}},
     "zero_optimization.offload_optimizer.device"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "nvme_path": "/nvme"}}},
     "zero_optimization.offload_optimizer.nvme_path"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/a"},
                            "offload_param": {"device": "nvme", "nvme_path": "/b"}}},
     "zero_optimization.offload_param.nvme_path"),
    ({"zero_optimization": {"stage": 2, "mics_shard_size": 8}}, "zero_optimization.mics_shard_size"),
    ({"fp16": {"enabled": True, "auto_cast": True}}, "fp16.auto_cast"),
    ({"fp16": {"enabled": True, "loss_scale": 128}}, "fp16.loss_scale"),
    ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, "optimizer.type"),
    ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False}}}, "optimizer.params.adam_w_mode"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}}, "optimizer.params.betas"),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, "scheduler.type"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "exp"}}}, "scheduler.params.warmup_type"),
    ({"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 99}}},
     "scheduler.params.last_batch_iteration"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}, "scheduler": {"type": "WarmupLR", "params": {}}},
     "scheduler.params.warmup_max_lr"),
    ({"flops_profiler": {"enabled": True}}, "flops_profiler.enabled"),
    ({"optimizer": {"params": {"lr": 1e-3}}}, "optimizer.type"),
    ({"train_batch_size": "eight"}, "train_batch_size"),
    ({"activation_checkpointing": {"partition_activations": True}}, "activation_checkpointing"),
])
def test_unsupported_deepspeed_keys_are_refused_by_path(config, path, tmp_path):
    f = tmp_path / "ds.json"
    f.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=rf"--deepspeed-config {f}: {path}: "):
        from_deepspeed(f)


@pytest.mark.parametrize("text,path", [
    ("deepspeed_config:\n  offload_param_device: disk\n", "deepspeed_config.offload_param_device"),
    ("deepspeed_config:\n  offload_optimizer_device: cpu\n  offload_optimizer_nvme_path: /nvme\n",
     "deepspeed_config.offload_optimizer_nvme_path"),
    ("deepspeed_config:\n  zero_stage: 1\n  deepspeed_moe_layer_cls_names: X\n",
     "deepspeed_config.deepspeed_moe_layer_cls_names"),
    ("fsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n", "fsdp_config"),
    ("mixed_precision: fp8\n", "mixed_precision"),
])
def test_unsupported_accelerate_keys_are_refused_by_path(text, path, tmp_path):
    f = tmp_path / "default_config.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=rf"--accelerate-config {f}: {path}: "):
        from_accelerate(f)


def test_configured_runs_train_exactly_like_their_flags(configs, tmp_path):
    """Two ranks (dp 2, ZeRO-2, bf16) configured three ways: the same loss at every iteration, bit
    for bit (they are the same job)."""
    ds, acc = configs
    losses = {}
    for name, extra in [("flags", FLAGS), ("deepspeed", ["--deepspeed-config", str(ds)]),
                        ("accelerate", ["--accelerate-config", str(acc)])]:
        path = tmp_path / f"{name}.jsonl"
        assert run_on_ranks(2, main_body, [*BASE, *extra, "--metrics-file", str(path)], timeout=300) == [0, 0]
        losses[name] = [(r["iteration"], r["loss"], r["lr"]) for r in read_metrics(path)[0]]
    assert len(losses["flags"]) == 4 and losses["flags"][1][2] == 2e-3          # warmed up by iteration 2
    assert losses["deepspeed"] == losses["flags"] and losses["accelerate"] == losses["flags"]


def test_zeropp_keys_land_on_their_flags(tmp_path, capsys):
    """DeepSpeed's ZeRO++ switches inside zero_optimization: zero_quantized_weights, zero_hpz_partition_size,
    zero_quantized_gradients (dp 4 here: hpZ blocks of 2)."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                                                    "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}}))
    assert from_deepspeed(ds) == {"zero.zero_stage": 3, "zero.quantized_weights": True, "zero.hpz_partition_size": 2,
                                  "zero.quantized_gradients": True}
    flags = ["--zero-stage", "3", "--zero-quantized-weights", "--zero-hpz-partition-size", "2",
             "--zero-quantized-gradients"]
    assert _settings(parse_job([*BASE, "--deepspeed-config", str(ds)], 4)[0]) == \
        _settings(parse_job([*BASE, *flags], 4)[0])
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}}))
    with pytest.raises(SystemExit):
        parse_job([*BASE, "--deepspeed-config", str(ds)], 4)
    assert "--zero-hpz-partition-size 3 must divide the data-parallel size 4" in capsys.readouterr().err


def test_accelerate_launch_keys_are_checked_against_torchrun(tmp_path):
    """num_processes / num_machines / machine_rank describe the launch or are refused (torchrun starts the
    run, not accelerate launch); without a launcher's numbers there is nothing to check them against."""
    launch = Launch.from_env(8, {"LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"})
    assert launch == Launch(8, 2, 1)
    assert Launch.from_env(1, {}) == Launch(1, 1, 0) and Launch.from_env(4, {}) == Launch(4, None, None)
    f = tmp_path / "default_config.yaml"
    f.write_text("distributed_type: MULTI_GPU\nnum_processes: 8\nnum_machines: 2\nmachine_rank: 1\n")
    assert from_accelerate(f, launch) == {} and from_accelerate(f, Launch(8)) == {}
    for env, key in [({"LOCAL_WORLD_SIZE": "8", "GROUP_RANK": "0"}, "num_machines"),
                     ({"LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0"}, "machine_rank")]:
        with pytest.raises(ConfigError, match=rf"^--accelerate-config {f}: .*{key}: is \d but this launch has"):
            from_accelerate(f, Launch.from_env(8, env))
    with pytest.raises(ConfigError, match=r"num_processes: is 8 but this launch has 4 processes \(WORLD_SIZE\)"):
        from_accelerate(f, Launch(4))


# Hugging Face's "ds_config_zero3.json" (transformers' DeepSpeed integration docs, ZeRO-3 example), with the
# bf16 section those docs give beside it: everything "auto" comes from the command line.
HF_ZERO3 = """{
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": true},
        "offload_param": {"device": "cpu", "pin_memory": true},
        "overlap_comm": true,
        "contiguous_gradients": true,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": true
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": false
}"""
# The same docs' WarmupDecayLR entry.
HF_DECAY = {"type": "WarmupDecayLR", "params": {"last_batch_iteration": -1, "total_num_steps": "auto",
                                                "warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                "warmup_num_steps": "auto"}}
# Megatron-DeepSpeed's examples' ds_config.json (bf16 on, fp16's section present but off).
MEGATRON_DS = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1,
               "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "prescale_gradients": False,
               "fp16": {"enabled": False, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
                        "min_loss_scale": 1, "initial_scale_power": 12},
               "bf16": {"enabled": True}, "wall_clock_breakdown": False}
LR, WARMUP, ITERS = 2e-3, 3, 6
SCHEDULE = ["--lr", str(LR), "--lr-warmup-iters", str(WARMUP), "--train-iters", str(ITERS), "--eval-interval", "6"]


def _lrs(ds: dict | str, flags: list[str], tmp_path) -> list[float]:
    """The learning rate of every iteration of a one-process run of pretrain_gpt.py with this config."""
    path, metrics = tmp_path / "ds.json", tmp_path / "metrics.jsonl"
    path.write_text(ds if isinstance(ds, str) else json.dumps(ds))
    argv = [*BASE, *SCHEDULE, *flags, "--deepspeed-config", str(path), "--metrics-file", str(metrics)]
    assert run_on_ranks(1, main_body, argv, timeout=300) == [0]
    records = read_metrics(metrics)[0]
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    assert all(math.isfinite(r["loss"]) for r in records)
    return [r["lr"] for r in records]


@pytest.mark.parametrize("scheduler", ["WarmupLR", "WarmupDecayLR"])
def test_hugging_face_zero3_auto_config_trains_with_the_command_lines_schedule(scheduler, tmp_path):
    """HF's ZeRO-3 "auto" JSON (CPU offload, stage3_* tuning keys) trains at once: warm-up steps, peak and
    decay from the command line, DeepSpeed's log warm-up (no warmup_type), its decay to 0 (WarmupDecayLR)."""
    ds = json.loads(HF_ZERO3)
    flags = ["--micro-batch-size", "2"]
    if scheduler == "WarmupDecayLR":
        ds["scheduler"] = HF_DECAY
        flags += ["--lr-decay-iters", str(ITERS)]
    lrs = _lrs(ds, flags, tmp_path)
    header = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])   # what the file resolved
    resolved = header["config_files"][f"--deepspeed-config {tmp_path / 'ds.json'}"]
    assert header["iteration"] == 0 and resolved["lr"] == {"value": LR, "auto": "from --lr"}
    assert resolved["lr_warmup_style"] == {"value": "log", "default": "DeepSpeed's default"}
    assert lrs[0] == pytest.approx(LR * math.log(2) / math.log(WARMUP))        # log(step + 1) / log(W), step 1
    assert lrs[WARMUP - 1] == pytest.approx(LR)                                # warmed up
    last = LR if scheduler == "WarmupLR" else LR * (ITERS - (ITERS - 1)) / (ITERS - WARMUP)
    assert lrs[-1] == pytest.approx(last)


def test_megatron_deepspeed_config_trains_with_the_command_lines_schedule(tmp_path):
    """A Megatron-DeepSpeed ds_config.json (batch sizes, ZeRO-1, clipping, bf16) with Megatron's schedule flags:
    linear warm-up, cosine decay to --min-lr."""
    lrs = _lrs(MEGATRON_DS, ["--min-lr", "2e-4", "--lr-decay-iters", str(ITERS), "--lr-decay-style", "cosine"],
               tmp_path)
    assert lrs[0] == pytest.approx(LR / WARMUP)
    assert lrs[WARMUP - 1] == pytest.approx(LR)
    ratio = (ITERS - 1 - WARMUP) / (ITERS - WARMUP)
    assert lrs[-1] == pytest.approx(2e-4 + 0.5 * (math.cos(math.pi * ratio) + 1) * (LR - 2e-4))


def test_implementation_only_keys_are_listed_on_one_warning_line(tmp_path, capsys):
    """Keys that only tune DeepSpeed's engine (or accelerate launch) are accepted, all named on one line;
    stage3_gather_16bit_weights_on_model_save and Accelerate's zero3_save_16bit_model alike."""
    ds, acc = tmp_path / "ds.json", tmp_path / "default_config.yaml"
    ds.write_text(HF_ZERO3)
    acc.write_text("compute_environment: LOCAL_MACHINE\nmain_process_port: 29501\ndeepspeed_config:\n"
                   "  zero3_save_16bit_model: true\n  zero_stage: 3\n  deepspeed_multinode_launcher: standard\n")
    parse_job([*BASE, "--micro-batch-size", "2", "--deepspeed-config", str(ds), "--accelerate-config", str(acc)], 1)
    lines = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(lines) == 1
    for key in ("steps_per_print", "wall_clock_breakdown", "zero_optimization.stage3_param_persistence_threshold",
                "zero_optimization.stage3_max_reuse_distance",
                "zero_optimization.stage3_gather_16bit_weights_on_model_save",
                f"--accelerate-config {acc}: main_process_port, deepspeed_config.zero3_save_16bit_model"):
        assert key in lines[0]
    assert "compute_environment" not in lines[0] and "deepspeed_multinode_launcher" not in lines[0]  # defaults
    unused = []
    from_deepspeed(_write(tmp_path, MEGATRON_DS), unused)
    assert [k for _, k in unused] == ["steps_per_print", "prescale_gradients", "wall_clock_breakdown",
                                      "fp16.loss_scale", "fp16.loss_scale_window", "fp16.hysteresis",
                                      "fp16.min_loss_scale", "fp16.initial_scale_power"]     # fp16 is off


def _write(tmp_path, config: dict):
    path = tmp_path / "written.json"
    path.write_text(json.dumps(config))
    return path


def test_every_refused_key_is_named_in_one_message(tmp_path, capsys):
    """Keys that would change training and have no equivalent: all in one refusal, not one per run."""
    bad = {"activation_checkpointing": {"partition_activations": True}, "fp16": {"enabled": True, "loss_scale": 128},
           "optimizer": {"type": "Lamb"}, "zero_optimization": {"stage": 2, "mics_shard_size": 8},
           "sparse_attention": {"mode": "fixed"}, "steps_per_print": 10}
    path = _write(tmp_path, bad)
    with pytest.raises(SystemExit):
        parse_job([*BASE, "--deepspeed-config", str(path)], 1)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"pretrain_gpt.py: error: --deepspeed-config {path}: 5 problems: ")
    for key in ("activation_checkpointing", "fp16.loss_scale", "optimizer.type", "zero_optimization.mics_shard_size",
                "sparse_attention"):
        assert key in err[0]
    assert "steps_per_print" not in err[0]


def test_scheduler_auto_and_defaults(tmp_path):
    """"auto" takes the command line's warm-up (no contradiction); an explicit WarmupDecayLR without
    warmup_type is DeepSpeed's log warm-up; absent parameters are DeepSpeed's defaults."""
    auto = _write(tmp_path, {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto",
                                                                          "warmup_max_lr": "auto"}}})
    job = parse_job([*BASE, "--deepspeed-config", str(auto), "--lr-warmup-iters", "2", "--lr", "5e-4"], 1)[0]
    assert (job.optimizer.lr_warmup_iters, job.optimizer.lr, job.optimizer.lr_warmup_style) == (2, 5e-4, "log")
    assert job.optimizer.lr_decay_style == "constant"
    explicit = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4,
                                                    "warmup_num_steps": 2, "total_num_steps": 4}}
    assert from_deepspeed(_write(tmp_path, {"scheduler": explicit})) == {
        "optimizer.lr_warmup_style": "log", "optimizer.lr_warmup_iters": 2, "optimizer.lr_decay_style": "linear",
        "optimizer.lr_decay_iters": 4, "optimizer.min_lr": 0.0, "optimizer.lr": 3e-4}
    bare = from_deepspeed(_write(tmp_path, {"scheduler": {"type": "WarmupCosineLR", "params": {}}}))
    assert bare["optimizer.lr_warmup_iters"] == 1000 and bare["optimizer.min_lr_ratio"] == 0.0001


def test_tuning_keys_with_an_equivalent_land_on_it(tmp_path):
    """stage3_max_live_parameters caps the layers gathered at once; communication_data_type picks the
    reduce dtype; stage 3's keys under stage 2 are unused, not applied."""
    ds = _write(tmp_path, {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 10 ** 9,
                                                 "stage3_max_live_parameters": 3 * 12288},
                           "communication_data_type": "fp32", "bf16": {"enabled": True}})
    job = parse_job([*BASE, "--deepspeed-config", str(ds)], 1)[0]     # a layer: 4*32^2 + 2*32*128 = 12288
    assert job.zero.prefetch_layers == 2 and job.zero.accumulate_allreduce_grads_in_fp32
    unused = []
    got = from_deepspeed(_write(tmp_path, {"zero_optimization": {"stage": 2, "stage3_max_live_parameters": 10,
                                                                 "allgather_bucket_size": 5e8,
                                                                 "reduce_scatter": False}}), unused)
    assert got == {"zero.zero_stage": 2}
    assert {k for _, k in unused} == {"zero_optimization.stage3_max_live_parameters",
                                      "zero_optimization.allgather_bucket_size", "zero_optimization.reduce_scatter"}


OLD_ACCELERATE = """\
compute_environment: LOCAL_MACHINE
deepspeed_config: {}
distributed_type: 'NO'
downcast_bf16: 'no'
dynamo_backend: 'NO'
fsdp_config: {}
gpu_ids: all
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
megatron_lm_config: {}
mixed_precision: 'no'
num_machines: 1
num_processes: 1
rdzv_backend: static
same_network: true
use_cpu: false
"""


def test_accelerate_files_of_older_versions_and_the_launch(tmp_path, capsys):
    """What older `accelerate config` versions wrote (empty sections, dynamo_backend 'NO') is accepted;
    num_processes against the launch is refused naming both numbers; a bad deepspeed_config_file is
    reported as the Accelerate file's key."""
    acc = tmp_path / "default_config.yaml"
    acc.write_text(OLD_ACCELERATE)
    assert from_accelerate(acc, Launch(1, 1, 0)) == {"compilation.compile": False}
    acc.write_text(OLD_ACCELERATE.replace("num_processes: 1", "num_processes: 2"))
    with pytest.raises(SystemExit):
        parse_job([*BASE, "--accelerate-config", str(acc)], 1)
    err = capsys.readouterr().err
    assert f"--accelerate-config {acc}: num_processes: is 2 but this launch has 1 process (WORLD_SIZE)" in err
    acc.write_text("deepspeed_config:\n  deepspeed_config_file: missing.json\n")
    with pytest.raises(ConfigError, match=rf"^--accelerate-config {acc}: deepspeed_config.deepspeed_config_file: "
                                          rf"{tmp_path}/missing.json: no such file$"):
        from_accelerate(acc)
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2, "mics_shard_size": 2}}))
    acc.write_text("mixed_precision: fp8\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n")
    with pytest.raises(ConfigError) as refused:
        from_accelerate(acc)
    assert "--deepspeed-config" not in str(refused.value)
    assert str(refused.value).startswith(f"--accelerate-config {acc}: 2 problems: mixed_precision: ")
    assert f"deepspeed_config.deepspeed_config_file {tmp_path}/ds.json: zero_optimization.mics_shard_size" \
        in str(refused.value)


def test_the_values_a_file_resolved_are_said_at_start_auto_ones_marked(tmp_path, capsys):
    """One line per file: each setting it gave, its "auto" ones with where their value came from, DeepSpeed's
    defaults it took (an absent warmup_type: the log warm-up, named); the same values in the job for the
    metrics file's first record."""
    config = {"gradient_clipping": "auto", "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "weight_decay": 0.1}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": "auto"}}}
    path = _write(tmp_path, config)
    job, _ = parse_job([*BASE, "--deepspeed-config", str(path), "--lr", "3e-4", "--adam-beta2", "0.95"], 1)
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"--deepspeed-config {path} resolved: ")
    for part in ("zero_stage=2", "weight_decay=0.1", "lr_warmup_iters=3", "lr_decay_style=constant",
                 "lr=0.0003 (auto: from --lr)", "adam_beta1=0.9 (auto: megazero's default)",
                 "adam_beta2=0.95 (auto: from --adam-beta2)", "clip_grad=1.0 (auto: megazero's default)",
                 "bucket_size=", "lr_warmup_style=log (absent: DeepSpeed's default; DeepSpeed's log warm-up"):
        assert part in line, part
    files = job.logging.config_files[f"--deepspeed-config {path}"]
    assert files["lr"] == {"value": 3e-4, "auto": "from --lr"} and files["weight_decay"] == {"value": 0.1}
    assert files["lr_warmup_style"] == {"value": "log", "default": "DeepSpeed's default"}
    assert parse_job(BASE, 1)[0].logging.config_files is None and capsys.readouterr().out == ""
