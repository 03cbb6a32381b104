"""The trainer's command line: Megatron flag names, config files, and errors that name the flag."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megazero.cli.arguments import flag_reference_markdown
from megazero.cli.job import parse_job

ROOT = Path(__file__).resolve().parents[1]


def test_megatron_flags_and_aliases_map_to_config():
    job, _ = parse_job(["--tensor-model-parallel-size", "2", "--pp", "2", "--zero-stage", "1",
                        "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
                        "--micro-batch-size", "2", "--global-batch-size", "16", "--lr", "3e-4",
                        "--bf16", "--data-path", "0.3", "a", "0.7", "b", "--no-overlap-grad-reduce",
                        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "sp.model",
                        "--eod-mask-loss"],
                       world_size=8)
    assert (job.parallel.tp, job.parallel.pp, job.parallel.dp) == (2, 2, 2)
    assert job.zero.zero_stage == 1 and job.zero.overlap_grad_reduce is False
    assert job.model.ffn_hidden_size == 128 and job.num_micro_batches == 4
    assert job.optimizer.lr == 3e-4 and job.precision.bf16
    assert job.data.data_path == ["0.3", "a", "0.7", "b"] and job.data.eod_mask_loss


def test_moe_flags_map_to_config():
    job, _ = parse_job(["--num-experts", "8", "--moe-router-topk", "1", "--moe-layer-freq", "2",
                        "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001",
                        "--moe-expert-capacity-factor", "1.25", "--expert-model-parallel-size", "2"], world_size=4)
    m = job.model
    assert (m.num_experts, m.moe_router_topk, m.moe_layer_freq) == (8, 1, 2)
    assert (m.moe_aux_loss_coeff, m.moe_z_loss_coeff, m.moe_expert_capacity_factor) == (0.01, 0.001, 1.25)
    assert job.parallel.expert_model_parallel_size == 2 and job.parallel.dp == 4


def test_every_flag_is_documented_in_the_flag_reference():
    from megazero.cli.arguments import arguments

    reference = (ROOT / "docs" / "flags.md").read_text()
    missing = [f for entries in arguments(builtin_only=True).values() for flags, _, _ in entries for f in flags
               if f"`{f}`" not in reference]
    assert not missing, f"flags not documented in docs/flags.md: {missing}"
    assert "docs/flags.md" in (ROOT / "README.md").read_text(), "README.md should link the flag reference"


def test_flag_reference_is_generated_from_the_metadata():
    page = ROOT / "docs" / "flags.md"
    assert page.is_file() and page.read_text() == flag_reference_markdown(), \
        "docs/flags.md is stale: regenerate it with `python -m megazero.cli.arguments --markdown > docs/flags.md`"


def test_model_family_flag_and_config_key(tmp_path):
    assert parse_job(["--model-family", "gpt"], world_size=1)[0].model.model_family == "gpt"
    cfg = tmp_path / "run.toml"
    cfg.write_text('model_family = "gpt"\n')
    assert parse_job(["--config", str(cfg)], world_size=1)[0].model.model_family == "gpt"


def test_config_file_with_cli_override(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('tp = 2\nzero-stage = 2\n[model]\nnum_layers = 6\nhidden-size = 48\n'
                   'num-attention-heads = 4\n')
    job, _ = parse_job(["--config", str(cfg), "--zero-stage", "1"], world_size=4)
    assert job.parallel.tp == 2 and job.parallel.dp == 2
    assert job.model.num_layers == 6 and job.model.hidden_size == 48
    assert job.zero.zero_stage == 1  # the command line wins


def test_llama_flags_and_negative_flag_in_a_config_file(tmp_path):
    flags = ["--position-embedding-type", "rope", "--rotary-base", "500000", "--normalization", "RMSNorm",
             "--norm-epsilon", "1e-6", "--swiglu", "--group-query-attention", "--num-query-groups", "2",
             "--disable-bias-linear", "--tp", "2"]
    m = parse_job(flags, world_size=2)[0].model
    assert (m.position_embedding_type, m.rotary_base, m.normalization, m.layernorm_epsilon) == ("rope", 5e5,
                                                                                                 "RMSNorm", 1e-6)
    assert m.swiglu and m.ffn_hidden_size == 320 and m.kv_heads == 2 and not m.add_bias_linear
    cfg = tmp_path / "llama.toml"
    cfg.write_text("swiglu = true\ndisable-bias-linear = true\ngroup_query_attention = true\n")
    m = parse_job(["--config", str(cfg)], world_size=1)[0].model
    assert m.swiglu and not m.add_bias_linear and m.num_query_groups == 1


def test_yaml_config_file(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("pp: 2\nnum-layers: 4\ndata-path: 1.0 prefix\ntokenizer-type: SentencePieceTokenizer\n"
                   "tokenizer-model: sp.model\n")
    job, _ = parse_job(["--config", str(cfg)], world_size=2)
    assert job.parallel.pp == 2 and job.data.data_path == ["1.0", "prefix"]


def test_unknown_config_key_is_an_error(tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text("num-layerz = 4\n")
    with pytest.raises(SystemExit) as e:
        parse_job(["--config", str(cfg)], world_size=1)
    assert e.value.code == 2
    assert "unknown key 'num-layerz'" in capsys.readouterr().err


def test_unknown_flag_is_one_line_naming_the_closest_flags(capsys):
    with pytest.raises(SystemExit) as e:
        parse_job(["--tensor-parallel", "2", "--num-layer", "4"], world_size=1)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 2 and "usage:" not in err
    assert "unrecognized argument --tensor-parallel: did you mean --tensor-model-parallel-size" in err
    assert "unrecognized argument --num-layer: did you mean --num-layers" in err


def test_a_bad_value_is_one_line_without_the_usage_block(capsys):
    with pytest.raises(SystemExit) as e:
        parse_job(["--zero-stage", "5"], world_size=1)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--zero-stage" in err and "invalid choice" in err


def test_every_flag_has_help_text_a_readable_placeholder_and_its_default():
    from megazero.cli.arguments import build_parser

    parser = build_parser()
    text = parser.format_help()
    actions = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert actions and all(a.help for a in actions), [a.option_strings for a in actions if not a.help]
    assert "." not in "".join(str(a.metavar or "") for a in actions)       # N, LR, DIR, not MODEL.NUM_LAYERS
    assert "MODEL." not in text and "OPTIMIZER." not in text
    assert "--num-layers N" in text and "--lr LR" in text and "--save DIR" in text
    assert "transformer layers (default: 4)" in " ".join(text.split())


def test_invalid_combination_exits_with_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        parse_job(["--tp", "2", "--num-attention-heads", "3", "--hidden-size", "48"], world_size=2)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--num-attention-heads 3" in err


@pytest.mark.slow
def test_torchrun_with_indivisible_world_fails_at_once():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                           str(ROOT / "pretrain_gpt.py"), "--tp", "2"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert done.returncode != 0
    # Each rank validates and prints the same one-line error; how many print before torchrun stops
    # the others is the launcher's timing, so: at least one, and every one exactly this line.
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("pretrain_gpt.py: error")]
    assert lines and set(lines) == {"pretrain_gpt.py: error: world size 3 is not divisible by tp*pp = 2*1 = 2: "
                                    "launch a multiple of 2 processes (e.g. --nproc-per-node 2) or change "
                                    "--tensor-model-parallel-size/--tp / --pipeline-model-parallel-size/--pp"}, \
        done.stderr[-3000:]
