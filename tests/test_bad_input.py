"""Bad input, table-driven: every case is refused with one line naming what is wrong, no traceback,
before any process group exists, and no file but the case's own new output changes.

Each case calls an entry point's ``main(argv)`` in this process (one import of torch for all of
them) with ``torch.distributed.init_process_group`` replaced by a tripwire, so a case that gets as
far as building a process group fails the test. The files the cases point at live in one
workspace, built once: a small GPT-2-tokenized dataset and broken copies of it, a two-iteration
checkpoint and broken copies of it, config files of every kind. Every file in the workspace is
hashed before and after each case. ``test_pretrain_gpt.py`` runs a few bad flags through a real
interpreter, and ``test_faults.py`` the inputs only found while running.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers import run_on_ranks
from helpers.data import GPT2_MERGES, GPT2_VOCAB
from helpers.trainer import ROOT, TINY, main_body

from megazero.checkpoint.format import TRACKER
from megazero.checkpoint.lock import SaveLock
from megazero.data.preprocess import PreprocessConfig, preprocess
from megazero.data.sample import TOKENIZER_MODEL, sample_documents

GPT2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(GPT2_VOCAB), "--merge-file", str(GPT2_MERGES)]
NO_DATA = [a for a in TINY if a != "--mock-data"] + ["--train-iters", "2"]


def mock(*flags):
    """The tiny trainer run on mock data, and ``flags``."""
    return ("pretrain", [*TINY, "--train-iters", "2", *flags])


def data(*flags):
    """The tiny trainer run with no data flags, and ``flags``."""
    return ("pretrain", [*NO_DATA, *flags])


def real(*flags):
    """The tiny trainer run with the GPT-2 tokenizer (give it a --data-path), and ``flags``."""
    return data(*GPT2, *flags)


def tool(name, *argv):
    return (name, list(argv))


# (id, (entry point, argv), exit status, text the one-line message must hold). "{W}" is the workspace.
CASES = [
    # numbers: nan, inf and out-of-range values
    ("lr-nan", mock("--lr", "nan"), 2, "--lr must be a finite number, got nan"),
    ("lr-inf", mock("--lr", "inf"), 2, "--lr must be a finite number, got inf"),
    ("lr-negative", mock("--lr", "-1"), 2, "--lr > 0"),
    ("min-lr-above-lr", mock("--min-lr", "1"), 2, "--min-lr (1.0) <= --lr"),
    ("decoupled-min-lr-alone", mock("--decoupled-min-lr", "1e-5"), 2, "--decoupled-min-lr needs --decoupled-lr"),
    ("clip-grad-nan", mock("--clip-grad", "nan"), 2, "--clip-grad must be a finite number"),
    ("clip-grad-negative", mock("--clip-grad", "-1"), 2, "--clip-grad and --weight-decay must be >= 0"),
    ("weight-decay-negative", mock("--weight-decay", "-0.1"), 2, "--clip-grad and --weight-decay must be >= 0"),
    ("norm-epsilon-negative", mock("--layernorm-epsilon=-1"), 2, "--norm-epsilon must be > 0"),
    ("init-method-std-zero", mock("--init-method-std", "0"), 2, "--init-method-std must be > 0"),
    ("init-method-std-inf", mock("--init-method-std", "inf"), 2, "--init-method-std must be a finite number"),
    ("adam-beta1-one", mock("--adam-beta1", "1"), 2, "--adam-beta1 and --adam-beta2 must be in [0, 1)"),
    ("adam-eps-zero", mock("--adam-eps", "0"), 2, "--adam-eps must be > 0"),
    ("hidden-dropout-one", mock("--hidden-dropout", "1"), 2, "--hidden-dropout must be in [0, 1)"),
    ("attention-dropout-nan", mock("--attention-dropout", "nan"), 2, "--attention-dropout must be a finite"),
    ("loss-scale-zero", mock("--fp16", "--initial-loss-scale", "0"), 2, "--initial-loss-scale must be > 0"),
    ("min-loss-scale-above", mock("--fp16", "--min-loss-scale", "1e9"), 2, "--min-loss-scale 1000000000.0 is above"),
    ("skipped-steps-zero", mock("--max-consecutive-skipped-steps", "0"), 2,
     "--max-consecutive-skipped-steps must be a positive integer"),
    ("timeout-zero", mock("--distributed-timeout-minutes", "0"), 2, "--distributed-timeout-minutes must be > 0"),
    ("timeout-nan", mock("--distributed-timeout-minutes", "nan"), 2, "--distributed-timeout-minutes must be a finite"),
    ("not-a-number", mock("--lr", "fast"), 2, "argument --lr: invalid float value: 'fast'"),
    ("seed-negative", mock("--seed=-1"), 2, "--seed must be in [0, 2**32), got -1"),
    ("lr-decay-iters-zero", mock("--lr-decay-iters", "0"), 2, "--lr-decay-iters must be a positive integer, got 0"),
    ("quantization-block-zero", mock("--zero-quantization-block-size", "0"), 2,
     "--zero-quantization-block-size must be >= 1, got 0"),
    # layout, model shape, batches, schedule
    ("tp-not-dividing-world", mock("--tp", "3"), 2, "world size 1 is not divisible by tp*pp"),
    ("dp-not-matching-world", mock("--dp", "2"), 2, "does not equal the world size 1"),
    ("heads-not-dividing-hidden", mock("--num-attention-heads", "3"), 2, "--hidden-size 32 is not divisible"),
    ("seq-length-zero", mock("--seq-length", "0"), 2, "--seq-length must be a positive integer"),
    ("positions-below-seq", mock("--max-position-embeddings", "8"), 2, "--max-position-embeddings 8 is smaller"),
    ("micro-batch-zero", mock("--micro-batch-size", "0"), 2, "--micro-batch-size must be a positive integer"),
    ("global-batch-indivisible", mock("--global-batch-size", "7"), 2, "--global-batch-size 7 is not divisible"),
    ("train-iters-zero", mock("--train-iters", "0"), 2, "--train-iters must be a positive integer"),
    ("exit-duration-zero", mock("--exit-duration-in-mins", "0"), 2,
     "--exit-duration-in-mins must be a positive number of minutes, got 0:"),
    ("exit-duration-negative", mock("--exit-duration-in-mins", "-5"), 2,
     "--exit-duration-in-mins must be a positive number of minutes, got -5:"),
    ("exit-duration-nan", mock("--exit-duration-in-mins", "nan"), 2,
     "--exit-duration-in-mins must be a finite number, got nan"),
    ("eval-interval-zero", mock("--eval-interval", "0"), 2, "--eval-interval must be a positive integer"),
    ("warmup-beyond-decay", mock("--lr-warmup-iters", "5", "--lr-decay-iters", "3"), 2,
     "--lr-warmup-iters 5 must be between 0 and --lr-decay-iters 3"),
    ("zero-stage-4", mock("--zero-stage", "4"), 2, "argument --zero-stage: invalid choice: 4"),
    ("keep-gathered-without-zero3", mock("--zero3-keep-params-gathered"), 2, "applies to --zero-stage 3 only"),
    ("virtual-stages-without-pp", mock("--num-layers-per-virtual-pipeline-stage", "1"), 2,
     "--num-layers-per-virtual-pipeline-stage needs"),
    ("bad-parallel-order", mock("--parallel-order", "tp-tp-dp"), 2, "--parallel-order 'tp-tp-dp' must name"),
    ("bf16-and-fp16", mock("--bf16", "--fp16"), 2, "--bf16 and --fp16 are exclusive"),
    ("moe-flag-without-experts", mock("--moe-router-topk", "1"), 2,
     "--moe-router-topk 1 applies to Mixture-of-Experts layers and this model has none: add --num-experts N"),
    ("moe-capacity-without-experts", mock("--moe-expert-capacity-factor", "1.5"), 2,
     "--moe-expert-capacity-factor 1.5 applies to Mixture-of-Experts layers"),
    # offloading
    ("offload-optimizer-zero0", mock("--offload-optimizer", "cpu"), 2, "use --zero-stage 1, 2 or 3"),
    ("offload-params-zero2", mock("--zero-stage", "2", "--offload-params", "cpu"), 2,
     "--offload-params cpu applies to --zero-stage 3 only"),
    ("offload-nvme-without-path", mock("--zero-stage", "1", "--offload-optimizer", "nvme"), 2,
     "offloading to nvme needs --nvme-path DIR"),
    ("nvme-path-without-nvme", mock("--zero-stage", "1", "--offload-optimizer", "cpu", "--nvme-path", "{W}"), 2,
     "--nvme-path {W} is used only with --offload-optimizer nvme or --offload-params nvme"),
    ("nvme-path-missing", mock("--zero-stage", "1", "--offload-optimizer", "nvme", "--nvme-path", "{W}/no_nvme"), 2,
     "--nvme-path {W}/no_nvme does not exist"),
    ("nvme-path-is-file", mock("--zero-stage", "3", "--offload-params", "nvme", "--nvme-path", "{W}/a_file"), 2,
     "--nvme-path {W}/a_file is a file, not a directory"),
    ("nvme-path-not-writable", mock("--zero-stage", "1", "--offload-optimizer", "nvme", "--nvme-path", "/proc"), 2,
     "--nvme-path /proc is not writable"),
    ("nvme-path-too-small", mock("--zero-stage", "1", "--offload-optimizer", "nvme", "--nvme-path", "{W}",
                                 "--num-layers", "96", "--hidden-size", "16384", "--num-attention-heads", "128"), 2,
     "the swap files need"),
    ("offload-sub-group-zero", mock("--zero-stage", "1", "--offload-optimizer", "cpu", "--offload-sub-group-size",
                                    "0"), 2, "--offload-sub-group-size must be a positive integer"),
    ("nccl-without-cuda", mock("--backend", "nccl"), 2, "--backend nccl needs CUDA"),
    ("unknown-flag", mock("--no-such-flag"), 2, "unrecognized argument --no-such-flag (pretrain_gpt.py --help lists"),
    ("abbreviated-flag", mock("--hidden", "64"), 2, "unrecognized argument --hidden: did you mean --hidden-size"),
    # data and tokenizer
    ("data-without-tokenizer", data("--data-path", "x"), 2, "--data-path needs --tokenizer-type"),
    ("mock-and-data", mock("--data-path", "{W}/gpt2_text_document", *GPT2), 2,
     "--mock-data and --data-path are exclusive"),
    ("gpt2-without-merges", real("--merge-file", "", "--data-path", "{W}/gpt2_text_document"), 2,
     "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file"),
    ("missing-prefix", real("--data-path", "{W}/nothing_here"), 2, "--data-path {W}/nothing_here"),
    ("bin-truncated", real("--data-path", "{W}/short"), 2, "--data-path {W}/short"),
    ("bin-missing", real("--data-path", "{W}/noidx"), 2, "--data-path {W}/noidx"),
    ("idx-garbage", real("--data-path", "{W}/garbage"), 2, "--data-path {W}/garbage"),
    ("ids-beyond-vocabulary", data("--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                                   str(TOKENIZER_MODEL), "--data-path", "{W}/gpt2_text_document"), 2,
     "but the tokenizer's vocabulary has"),
    ("missing-vocab-file", data("--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "{W}/no_vocab.json",
                                "--merge-file", str(GPT2_MERGES), "--data-path", "{W}/gpt2_text_document"), 2,
     "{W}/no_vocab.json"),
    ("missing-tokenizer-model", data("--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                                     "{W}/no.model", "--data-path", "{W}/gpt2_text_document"), 2, "{W}/no.model"),
    ("blend-weight-negative", real("--data-path", "-1", "{W}/gpt2_text_document", "1", "{W}/gpt2_text_document"),
     2, "--data-path weight '-1' must be a positive number"),
    ("blend-weight-nan", real("--data-path", "nan", "{W}/gpt2_text_document", "1", "{W}/gpt2_text_document"),
     2, "--data-path weight 'nan' must be a positive number"),
    ("blend-odd-count", real("--data-path", "1", "{W}/gpt2_text_document", "1"), 2, "takes weight-prefix pairs"),
    ("split-no-training", real("--data-path", "{W}/gpt2_text_document", "--split", "0,1,0"), 2,
     "--split '0,1,0' must be up to three non-negative weights"),
    ("split-train-too-small", real("--data-path", "{W}/gpt2_text_document", "--split", "1,1000,0"), 2,
     "the training split of --split '1,1000,0' (documents 0..0) holds 0 tokens, too few for one sample"),
    ("split-words", mock("--split", "a,b"), 2, "--split 'a,b'"),
    ("split-four-parts", mock("--split", "1,2,3,4"), 2, "--split '1,2,3,4'"),
    # output paths
    ("metrics-file-is-directory", mock("--metrics-file", "{W}"), 2, "--metrics-file {W} is a directory"),
    ("metrics-file-dir-is-file", mock("--metrics-file", "{W}/a_file/metrics.jsonl"), 2,
     "--metrics-file {W}/a_file/metrics.jsonl: its directory {W}/a_file is a file"),
    ("save-is-file", mock("--save", "{W}/a_file"), 2, "--save {W}/a_file is a file, not a directory"),
    ("save-under-file", mock("--save", "{W}/a_file/run"), 2, "--save {W}/a_file/run: {W}/a_file is not a writable"),
    ("cache-is-file", real("--data-path", "{W}/gpt2_text_document", "--data-cache-path", "{W}/a_file"), 2,
     "--data-cache-path {W}/a_file is a file"),
    ("tensorboard-is-file", mock("--tensorboard-dir", "{W}/a_file"), 2, "--tensorboard-dir {W}/a_file is a file"),
    # watching a run: the profiler, W&B, MFU
    ("profile-start-without-profile", mock("--profile-step-start", "1"), 2,
     "--profile-step-start applies with --profile: add --profile or drop --profile-step-start"),
    ("profile-dir-without-profile", mock("--profile-dir", "{W}/traces"), 2, "--profile-dir applies with --profile"),
    ("profile-end-not-after-start", mock("--profile", "--profile-step-start", "1", "--profile-step-end", "1"), 2,
     "--profile-step-end 1 must be above --profile-step-start 1"),
    ("profile-after-the-run", mock("--profile"), 2,
     "--profile-step-start 10 is not below --train-iters 2: nothing would be profiled"),
    ("live-bytes-under-the-profiler", mock("--profile", "--profile-step-start", "0", "--measure-live-bytes"), 2,
     "--measure-live-bytes and --profile would both run torch's profiler over iterations 1-2"),
    ("profile-rank-outside-world", mock("--profile", "--profile-step-start", "0", "--profile-ranks", "0", "3"), 2,
     "--profile-ranks 0 3: rank(s) 3 not in this world of 1 (ranks 0-0)"),
    ("profile-dir-is-file", mock("--profile", "--profile-step-start", "0", "--profile-dir", "{W}/a_file"), 2,
     "--profile-dir {W}/a_file is a file"),
    ("wandb-name-without-project", mock("--wandb-exp-name", "tiny"), 2,
     "--wandb-exp-name applies with --wandb-project: add --wandb-project NAME"),
    ("peak-tflops-zero", mock("--peak-tflops", "0"), 2, "--peak-tflops must be > 0, got 0.0"),
    # checkpoints
    ("save-holds-another-run", mock("--save", "{W}/run"), 2, "--save {W}/run already holds another run's"),
    ("save-locked", mock("--save", "{W}/locked", "--load", "{W}/locked"), 2,
     "--save {W}/locked is in use by another run (pid"),
    ("load-missing", mock("--load", "{W}/no_such_run"), 2, "--load {W}/no_such_run does not exist"),
    ("load-empty", mock("--load", "{W}/empty_dir"), 2, "--load {W}/empty_dir holds no checkpoint"),
    ("load-tracker-garbage", mock("--load", "{W}/run_bad_tracker"), 2, TRACKER),
    ("load-tracker-to-missing", mock("--load", "{W}/run_lost_iteration"), 2, "iter_0000099"),
    ("load-other-model", mock("--load", "{W}/run", "--hidden-size", "64"), 2,
     "{W}/run was saved with --hidden-size 32, this run has 64"),
    ("load-index-garbage", mock("--load", "{W}/run_bad_index"), 2, "{W}/run_bad_index"),
    ("load-finished-run", mock("--load", "{W}/run"), 0,                  # exit 0, said on stdout
     "--load {W}/run holds a checkpoint at iteration 2, and --train-iters is 2: nothing is left to train"),
    ("save-interval-without-save", mock("--save-interval", "1"), 2, "--save-interval needs --save"),
    ("async-save-without-save", mock("--async-save"), 2, "--async-save needs --save"),
    ("finetune-without-load", mock("--finetune"), 2, "--finetune needs --load"),
    # config files
    ("config-missing", mock("--config", "{W}/no.toml"), 2, "--config {W}/no.toml: no such file"),
    ("config-bool-as-string", mock("--config", "{W}/bool_string.toml"), 2, "'bf16' must be true or false, got 'false'"),
    ("config-int-as-string", mock("--config", "{W}/int_string.yaml"), 2, "'num-layers' must be an integer, got '4'"),
    ("config-unknown-key", mock("--config", "{W}/unknown.toml"), 2, "unknown key 'model.hiden-size'"),
    ("config-duplicate-yaml", mock("--config", "{W}/duplicate.yaml"), 2, "key 'lr' is given twice"),
    ("config-two-spellings", mock("--config", "{W}/two_spellings.toml"), 2, "'num_layers' sets what 'num-layers'"),
    ("config-not-toml", mock("--config", "{W}/broken.toml"), 2, "--config {W}/broken.toml: not valid TOML"),
    ("config-bad-choice", mock("--config", "{W}/bad_choice.toml"), 2, "'zero-stage' must be one of 0, 1, 2, 3"),
    ("deepspeed-not-json", mock("--deepspeed-config", "{W}/broken.json"), 2, "not valid JSON"),
    ("deepspeed-unsupported-key", mock("--deepspeed-config", "{W}/ds_unsupported.json"), 2,
     "progressive_layer_drop.enabled: DeepSpeed's progressive_layer_drop is not in megazero"),
    ("deepspeed-optimizer-sgd", mock("--deepspeed-config", "{W}/ds_sgd.json"), 2, "optimizer.type"),
    ("deepspeed-batch-disagrees", mock("--deepspeed-config", "{W}/ds_batch.json"), 2,
     "--global-batch-size 8 is not micro-batch 2 x gradient accumulation steps 3"),
    ("deepspeed-disagrees-with-flag", mock("--deepspeed-config", "{W}/ds_clip.json", "--clip-grad", "0.5"), 2,
     "set it in one place"),
    ("accelerate-unsupported-key", mock("--accelerate-config", "{W}/acc_unsupported.yaml"), 2,
     "deepspeed_config.enable_msamp: not supported by megazero"),
    ("accelerate-offload-device", mock("--accelerate-config", "{W}/acc_offload.yaml"), 2,
     "deepspeed_config.offload_optimizer_device: must be none, cpu or nvme, got 'gpu'"),
    ("accelerate-fp8", mock("--accelerate-config", "{W}/acc_fp8.yaml"), 2, "mixed_precision"),
    ("config-contradicts-deepspeed", mock("--config", "{W}/stage1.toml", "--deepspeed-config", "{W}/stage2.json"), 2,
     "--zero-stage is 1 in --config {W}/stage1.toml but 2 in --deepspeed-config {W}/stage2.json: set it in one place"),
    ("deepspeed-contradicts-accelerate", mock("--deepspeed-config", "{W}/ds_clip.json", "--accelerate-config",
                                              "{W}/acc_clip.yaml"), 2,
     "--clip-grad is 1.0 in --deepspeed-config {W}/ds_clip.json but 0.5 in --accelerate-config {W}/acc_clip.yaml"),
    ("accelerate-contradicts-its-deepspeed-file", mock("--accelerate-config", "{W}/acc_stage2.yaml"), 2,
     "--accelerate-config {W}/acc_stage2.yaml: deepspeed_config.deepspeed_config_file: --zero-stage is 2 in this "
     "file but 3 in {W}/ds_stage3.json: set it in one place"),
    ("deepspeed-duplicate-key", mock("--deepspeed-config", "{W}/ds_duplicate.json"), 2,
     "--deepspeed-config {W}/ds_duplicate.json: key 'gradient_clipping' is given twice in one object: keep one"),
    ("accelerate-duplicate-key", mock("--accelerate-config", "{W}/acc_duplicate.yaml"), 2,
     "--accelerate-config {W}/acc_duplicate.yaml: key 'zero_stage' is given twice: keep one"),
    ("accelerate-unknown-distributed-type", mock("--accelerate-config", "{W}/acc_foobar.yaml"), 2,
     "distributed_type: must be one of NO, MULTI_CPU"),
    ("accelerate-fsdp", mock("--accelerate-config", "{W}/acc_fsdp.yaml"), 2,
     "distributed_type: FSDP is not supported: megazero shards with ZeRO"),
    ("accelerate-num-processes", mock("--accelerate-config", "{W}/acc_processes.yaml"), 2,
     "num_processes: is 8 but this launch has 1 process (WORLD_SIZE)"),
    ("accelerate-num-machines", mock("--accelerate-config", "{W}/acc_machines.yaml"), 2,
     "num_machines: is 2 but this launch has 1 node"),
    ("accelerate-machine-rank", mock("--accelerate-config", "{W}/acc_machine_rank.yaml"), 2,
     "machine_rank: is 1 but this launch has 0 as this node's rank"),
    # tools
    ("convert-existing-output", tool("convert_checkpoint", "--input", "{W}/run/iter_0000002", "--output",
                                     "{W}/run_bad_index", "--to", "megazero"), 1, "--overwrite"),
    ("convert-target-tp-negative", tool("convert_checkpoint", "--input", "{W}/run/iter_0000002", "--output",
                                        "{W}/out/tp", "--to", "megazero", "--target-tp=-1"), 1, "--target-tp"),
    ("convert-output-is-input", tool("convert_checkpoint", "--input", "{W}/run/iter_0000002", "--output",
                                     "{W}/run/iter_0000002", "--to", "hf", "--overwrite"), 1, "--output is --input"),
    ("convert-not-a-checkpoint", tool("convert_checkpoint", "--input", "{W}/empty_dir", "--output", "{W}/out/x",
                                      "--to", "hf"), 1, "{W}/empty_dir"),
    ("preprocess-existing-output", tool("preprocess_data", "--input", "{W}/corpus.jsonl", "--output-prefix",
                                        "{W}/gpt2", *GPT2), 2, "--overwrite"),
    ("preprocess-missing-input", tool("preprocess_data", "--input", "{W}/no.jsonl", "--output-prefix",
                                      "{W}/out/x", *GPT2), 2, "{W}/no.jsonl"),
    ("estimate-bad-layout", tool("estimate_memory", *TINY, "--world-size", "3", "--tp", "2"), 2,
     "world size 3 is not divisible by tp*pp"),
    ("hpz-spans-nodes", tool("estimate_memory", *TINY, "--world-size", "8", "--global-batch-size", "16",
                             "--zero-stage", "3", "--zero-hpz-partition-size", "4", "--ranks-per-node", "2"), 2,
     "--zero-hpz-partition-size 4 puts ranks [0, 1, 2, 3] of nodes of 2 ranks in one secondary partition, which "
     "spans nodes"),
    ("inspect-corrupt-tracker", tool("inspect_checkpoint", "{W}/run_bad_tracker"), 1, TRACKER),
    ("import-config-disagrees-with-weights", tool("convert_checkpoint", "--input", "{W}/hf_wide", "--output",
                                                  "{W}/out/wide", "--to", "megazero"), 1,
     "{W}/hf_wide against its config.json: layers.0.attention.qkv.bias is [96] but the config (hidden_size 64"),
    ("import-truncated-safetensors", tool("convert_checkpoint", "--input", "{W}/hf_truncated", "--output",
                                          "{W}/out/truncated", "--to", "megazero"), 1,
     "{W}/hf_truncated/model.safetensors cannot be read as safetensors"),
    ("import-config-not-json", tool("convert_checkpoint", "--input", "{W}/hf_config_garbage", "--output",
                                    "{W}/out/garbage", "--to", "megazero"), 1,
     "{W}/hf_config_garbage/config.json is not valid JSON"),
    ("import-pickled-bin", tool("convert_checkpoint", "--input", "{W}/hf_pickle", "--output", "{W}/out/pickle",
                                "--to", "megazero"), 1,
     "{W}/hf_pickle/pytorch_model.bin cannot be read as plain tensors (it holds pickled Python objects besides "
     "tensors): megazero does not unpickle Python objects"),
    ("inspect-index-disagrees-with-config", tool("inspect_checkpoint", "{W}/run_wide_config"), 1,
     "{W}/run_wide_config/iter_0000002/index.json: embedding.position_embeddings.weight is [16, 32] but the config "
     "(hidden_size 64"),
    ("inspect-index-disagrees-with-file", tool("inspect_checkpoint", "{W}/run_wrong_shard"), 1,
     "stores 32 elements under 'model/final_norm.bias', the index says 33 (tensor 'model/final_norm.bias' of "
     "shape [33])"),
    ("inspect-manifest-garbage", tool("inspect_checkpoint", "{W}/run_bad_manifest"), 1,
     "{W}/run_bad_manifest/iter_0000002/manifest.json is not valid JSON"),
    ("inspect-index-garbage", tool("inspect_checkpoint", "{W}/run_bad_index"), 1,
     "{W}/run_bad_index/iter_0000002/index.json has 10 bytes, the manifest says"),
    ("tokenizer-vocabulary-below-characters", tool("train_tokenizer", "--input", "{W}/many_chars.txt",
                                                   "--model-prefix", "{W}/out/sp", "--vocab-size", "300"), 1,
     "--vocab-size 300 is below the 667 pieces the input's distinct characters"),
    ("generate-negative-tokens", tool("generate", "--load", "{W}/run", "--prompt-ids", "1", "--max-new-tokens",
                                      "-3"), 2, "--max-new-tokens must be a positive integer, got -3"),
    ("generate-missing-checkpoint", tool("generate", "--load", "{W}/no_such_run", "--prompt-ids", "1"), 1,
     "{W}/no_such_run"),
    # tools that take a run's flags: what the trainer refuses, they refuse, and their own arguments before any run
    ("check-layout-world-not-divisible", tool("check_layout", "--world-size", "3", "--", "--tp", "2"), 2,
     "the plan is refused: world size 3 is not divisible by tp*pp = 2*1 = 2"),
    ("check-layout-world-and-dp-disagree", tool("check_layout", "--world-size", "8", "--", "--tp", "2", "--dp", "2"),
     2, "(dp 2) does not equal the world size 8"),
    ("check-layout-workdir-is-a-file", tool("check_layout", "--workdir", "{W}/corpus.jsonl", "--", "--tp", "2",
                                            "--dp", "1"), 2,
     "--workdir {W}/corpus.jsonl: {W}/corpus.jsonl is a file, not a directory"),
    ("fuzz-minutes-negative", tool("fuzz_layouts", "--minutes=-1", "--dry-run"), 2,
     "--minutes must be > 0 (the time within which draws start), got -1.0"),
    ("fuzz-reference-samples-negative", tool("fuzz_layouts", "--reference-samples", "-5", "--dry-run"), 2,
     "--reference-samples must be >= 0"),
    ("fuzz-workdir-under-a-file", tool("fuzz_layouts", "--workdir", "{W}/corpus.jsonl/runs"), 2,
     "--workdir {W}/corpus.jsonl/runs: {W}/corpus.jsonl is a file, not a directory"),
    ("fuzz-results-in-a-missing-folder", tool("fuzz_layouts", "--results", "{W}/no_such_folder/r.jsonl"), 2,
     "--results {W}/no_such_folder/r.jsonl: the folder {W}/no_such_folder does not exist"),
    ("fuzz-results-of-a-dry-run", tool("fuzz_layouts", "--results", "{W}/r.jsonl", "--dry-run"), 2,
     "--results records checked draws and --dry-run checks none: drop one of them"),
    ("estimate-fit-beside-recompute", tool("estimate_memory", *TINY, "--fit-gib", "1", "--recompute-activations"), 2,
     "--fit-gib lets the planner choose recompute and offload; --recompute-activations chooses too: drop one"),
    ("estimate-world-size-zero", tool("estimate_memory", *TINY, "--world-size", "0"), 2,
     "--world-size must be >= 1, got 0"),
    ("estimate-fit-beside-budget", tool("estimate_memory", *TINY, "--fit-gib", "1", "--memory-budget-gib", "2"), 2,
     "--fit-gib and --memory-budget-gib both ask the memory planner for a plan: keep one"),
    ("zero-bubble-at-pp1", mock("--pipeline-schedule", "zb-v"), 2,
     "--pipeline-schedule zb-v is a zero-bubble pipeline schedule and does nothing at"),
    ("cp-comm-type-at-cp1", mock("--cp-comm-type", "allgather"), 2,
     "--cp-comm-type allgather chooses how context-parallel ranks share keys and values and does nothing at"),
]


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """Every file the cases name (see the module docstring); a lock on ``locked/`` held throughout."""
    w = tmp_path_factory.mktemp("inputs")
    _write(w / "corpus.jsonl", "".join(json.dumps({"text": d}) + "\n" for d in sample_documents()[:20]))
    preprocess(PreprocessConfig(input=str(w / "corpus.jsonl"), output_prefix=str(w / "gpt2"), append_eod=True,
                                tokenizer_type="GPT2BPETokenizer", vocab_file=str(GPT2_VOCAB),
                                merge_file=str(GPT2_MERGES)), lambda line: None)
    prefix = w / "gpt2_text_document"
    for name in ("short", "noidx", "garbage"):
        shutil.copy(f"{prefix}.idx", w / f"{name}.idx")
        shutil.copy(f"{prefix}.bin", w / f"{name}.bin")
    (w / "short.bin").write_bytes((w / "short.bin").read_bytes()[:-100])
    (w / "noidx.bin").unlink()
    (w / "garbage.idx").write_bytes(b"not an index" * 10)
    (w / "a_file").write_text("a file where a directory should be\n")
    (w / "empty_dir").mkdir()

    assert run_on_ranks(1, main_body, [*TINY, "--train-iters", "2", "--save", str(w / "run")], timeout=120) == [0]
    for name in ("run_bad_tracker", "run_lost_iteration", "run_bad_index"):
        shutil.copytree(w / "run", w / name)
    (w / "run_bad_tracker" / TRACKER).write_text("two\n")
    (w / "run_lost_iteration" / TRACKER).write_text("99\n")
    (w / "run_bad_index" / "iter_0000002" / "index.json").write_text("{ not json")
    lock = SaveLock.acquire(w / "locked")

    _write(w / "bool_string.toml", 'bf16 = "false"\n')
    _write(w / "int_string.yaml", 'num-layers: "4"\n')
    _write(w / "unknown.toml", "[model]\nhiden-size = 64\n")
    _write(w / "duplicate.yaml", "lr: 0.1\nlr: 0.2\n")
    _write(w / "two_spellings.toml", "num-layers = 4\nnum_layers = 4\n")
    _write(w / "broken.toml", "tp = = 2\n")
    _write(w / "bad_choice.toml", "zero-stage = 5\n")
    _write(w / "broken.json", '{"train_batch_size": 8,')
    _write(w / "ds_unsupported.json", json.dumps({"zero_optimization": {"stage": 1},
                                                        "progressive_layer_drop": {"enabled": True, "theta": 0.5}}))
    _write(w / "ds_sgd.json", json.dumps({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}))
    _write(w / "ds_batch.json", json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}))
    _write(w / "ds_clip.json", json.dumps({"gradient_clipping": 1.0}))
    _write(w / "acc_unsupported.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 1\n"
                                       "  enable_msamp: true\n")
    _write(w / "acc_offload.yaml", "deepspeed_config:\n  zero_stage: 2\n  offload_optimizer_device: gpu\n")
    _write(w / "acc_fp8.yaml", "distributed_type: DEEPSPEED\nmixed_precision: fp8\ndeepspeed_config:\n"
                               "  zero_stage: 1\n")
    _broken_copies(w)
    _write(w / "stage1.toml", "zero-stage = 1\n")
    _write(w / "stage2.json", json.dumps({"zero_optimization": {"stage": 2}}))
    _write(w / "ds_stage3.json", json.dumps({"zero_optimization": {"stage": 3}}))
    _write(w / "acc_stage2.yaml", "deepspeed_config:\n  zero_stage: 2\n  deepspeed_config_file: ds_stage3.json\n")
    _write(w / "acc_clip.yaml", "deepspeed_config:\n  gradient_clipping: 0.5\n")
    _write(w / "ds_duplicate.json", '{"gradient_clipping": 1.0, "gradient_clipping": 0.5}')
    _write(w / "acc_duplicate.yaml", "deepspeed_config:\n  zero_stage: 1\n  zero_stage: 2\n")
    _write(w / "acc_foobar.yaml", "distributed_type: FOOBAR\n")
    _write(w / "acc_fsdp.yaml", "distributed_type: FSDP\n")
    _write(w / "acc_processes.yaml", "distributed_type: MULTI_CPU\nnum_processes: 8\n")
    _write(w / "acc_machines.yaml", "distributed_type: MULTI_CPU\nnum_machines: 2\n")
    _write(w / "acc_machine_rank.yaml", "distributed_type: MULTI_CPU\nmachine_rank: 1\n")
    yield w
    lock.release()


def _rewrite_index(iteration_dir: Path, change) -> None:
    """Edit a checkpoint's index.json with ``change(index)`` and record the new file in the manifest,
    so the checksums pass and only what the change says is wrong."""
    from megazero.checkpoint.format import INDEX, MANIFEST, file_record

    index = json.loads((iteration_dir / INDEX).read_text())
    change(index)
    (iteration_dir / INDEX).write_text(json.dumps(index))
    manifest = json.loads((iteration_dir / MANIFEST).read_text())
    manifest["files"][INDEX] = file_record(iteration_dir / INDEX)
    (iteration_dir / MANIFEST).write_text(json.dumps(manifest))


def _broken_copies(w: Path) -> None:
    """HF directories and checkpoints that disagree with themselves, from the two-iteration ``run``."""
    import torch

    from megazero.checkpoint.hf import save_hf
    from megazero.checkpoint.offline import read_model

    cfg, tensors, _ = read_model(w / "run")
    save_hf(w / "hf", tensors, cfg)
    for name in ("hf_wide", "hf_truncated", "hf_config_garbage"):
        shutil.copytree(w / "hf", w / name)
    config = json.loads((w / "hf" / "config.json").read_text())
    (w / "hf_wide" / "config.json").write_text(json.dumps({**config, "n_embd": 64, "n_inner": 256}))
    (w / "hf_truncated" / "model.safetensors").write_bytes((w / "hf" / "model.safetensors").read_bytes()[:3000])
    (w / "hf_config_garbage" / "config.json").write_text("{ not json")
    (w / "hf_pickle").mkdir()
    shutil.copy(w / "hf" / "config.json", w / "hf_pickle")
    torch.save({"weights": Path("an object that is not a tensor")}, w / "hf_pickle" / "pytorch_model.bin")
    for name in ("run_wide_config", "run_wrong_shard", "run_bad_manifest"):
        shutil.copytree(w / "run", w / name)
    _rewrite_index(w / "run_wide_config" / "iter_0000002",
                   lambda index: index["job"]["model"].update(hidden_size=64, ffn_hidden_size=256))

    def one_more_element(index):
        shard = index["tensors"]["model/final_norm.bias"]["shards"][0]
        shard["flat"][1] += 1
        shard["slice"][0][1] += 1
        index["tensors"]["model/final_norm.bias"]["shape"][0] += 1

    _rewrite_index(w / "run_wrong_shard" / "iter_0000002", one_more_element)
    (w / "run_bad_manifest" / "iter_0000002" / "manifest.json").write_text("{ not json")
    (w / "many_chars.txt").write_text("".join(chr(0x4E00 + i) for i in range(400)) + "\n" + "hello world\n" * 10)


def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _entry_point(name: str):
    if name == "pretrain":
        from megazero.cli import main as cli

        return cli.main
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_the_table_has_sixty_distinct_cases():
    assert len({c[0] for c in CASES}) == len(CASES) >= 60
    assert len({json.dumps(c[1]) for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused(case, workspace, capsys, monkeypatch):
    name, (entry, argv), status, message = case
    w = str(workspace)
    argv = [a.replace("{W}", w) for a in argv]

    def tripwire(*args, **kwargs):
        raise AssertionError(f"{name}: a process group was created before the input was refused")

    monkeypatch.setattr(dist, "init_process_group", tripwire)
    before = _hashes(workspace)
    main = _entry_point(entry)
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    lines = (err if status else out).strip().splitlines()      # exit 0: what there is to say is on stdout
    assert code == status, f"exit {code}, stderr: {err}"
    assert "Traceback" not in err
    assert lines and message.replace("{W}", w) in lines[-1], err       # the message is the last line, whole
    assert _hashes(workspace) == before                                 # no input changed
    assert not dist.is_initialized()


def test_wandb_project_without_wandb_is_one_line_before_any_process_group(capsys, monkeypatch):
    """Whether or not wandb is installed here, the run sees it missing: one line naming the install."""
    monkeypatch.setitem(sys.modules, "wandb", None)            # import wandb -> ImportError, find_spec -> None

    def tripwire(*args, **kwargs):
        raise AssertionError("a process group was created before the input was refused")

    monkeypatch.setattr(dist, "init_process_group", tripwire)
    from megazero.cli import main as cli

    with pytest.raises(SystemExit) as stopped:
        cli.main([*TINY, "--train-iters", "2", "--wandb-project", "tiny"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == ["pretrain_gpt.py: error: --wandb-project needs the wandb package, which is "
                                        "not installed: pip install wandb"]


def test_an_empty_validation_split_is_said_at_start(workspace, capsys, monkeypatch):
    """A --split whose validation part holds no document: the run says at start that validation will
    not run (before any process group), instead of silently never evaluating."""
    class Started(Exception):
        pass

    def started(*args, **kwargs):
        raise Started

    monkeypatch.setattr(dist, "init_process_group", started)
    from megazero.cli import main as cli

    with pytest.raises(Started):
        cli.main([*NO_DATA, *GPT2, "--data-path", f"{workspace}/gpt2_text_document", "--split", "1000,1,0"])
    out = capsys.readouterr().out
    assert "the validation split of --split '1000,1,0' holds none of the 20 documents" in out
    assert "validation will not run" in out


@pytest.mark.parametrize("name", ["run_bad_manifest", "run_bad_index"])
def test_a_damaged_checkpoint_is_one_line_in_a_real_interpreter(name, workspace):
    """In a real interpreter, where a failing destructor would print "Exception ignored in:
    CheckpointReader.__del__" and its traceback after the message: the message is all of stderr."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, str(ROOT / "tools" / "inspect_checkpoint.py"), str(workspace / name)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert run.stderr.startswith(f"error: checkpoint file {workspace / name}"), run.stderr


def test_a_full_disk_during_a_conversion_is_one_line_and_leaves_no_tmp(workspace, tmp_path, capsys, monkeypatch):
    """convert_checkpoint.py on a disk that fills while it writes (a write raising ENOSPC): one line,
    status 1, and no half-written .iter_*.tmp left in --output."""
    import errno

    import megazero.checkpoint.offline as offline

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(offline, "write_pieces", full)
    out = tmp_path / "converted"
    code = _entry_point("convert_checkpoint")(["--input", str(workspace / "hf"), "--output", str(out), "--to",
                                               "megazero"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"writing {out / 'iter_0000000'} failed: No space left on device (free space there" in err
    assert not list(out.glob(".iter_*"))
