"""DeepSpeed JSON and Accelerate YAML configs: each key lands on its flag, "auto" defers to the
flags, an unsupported key is refused by its path, and a run configured either way trains exactly
like the same run configured by flags."""
from __future__ import annotations

import json

import pytest
from helpers import run_on_ranks
from helpers.trainer import main_body, read_metrics

from megazero.arguments import parse_job
from megazero.config import ConfigError
from megazero.foreign_config import from_accelerate, from_deepspeed

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
    they fill the fields the flags set directly)."""
    out = {section: vars(getattr(job, section)).copy() for section in vars(job)}
    out["train"].pop("gradient_accumulation_steps")
    out["optimizer"].pop("min_lr_ratio")
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
    from megazero.foreign_config import Launch

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
    with pytest.raises(ConfigError, match=r"num_processes: is 8 but this launch has 4 process\(es\) \(WORLD_SIZE\)"):
        from_accelerate(f, Launch(4))
