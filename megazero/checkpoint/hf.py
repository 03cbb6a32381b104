"""HuggingFace model directories <-> megazero whole tensors: the files, and the dispatch to a model
family's HF adapter (``ModelSpec.hf``, :mod:`megazero.spec`).

    save_hf(out_dir, tensors, cfg, data_cfg=job.data)     # config.json + safetensors (+ tokenizer files)
    cfg, tensors = load_hf(path)                          # single or sharded safetensors, or pytorch_model.bin

Which format: on export, the adapter of the model's family (``cfg.model_family``) writes the config and
maps the tensors (the GPT family: GPT-2's ``GPT2LMHeadModel`` for learned positions, the Llama family's
``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` for RoPE, :mod:`megazero.models.gpt.spec`); on import, the
family whose adapter reads the config's ``model_type`` (GPT-2 when absent).

Weights above ``max_shard_bytes`` are split, as ``save_pretrained`` does, into
``model-00001-of-0000N.safetensors`` ... with ``model.safetensors.index.json`` (``weight_map``: tensor
name -> file; ``metadata.total_size``: bytes). The names a converted model must have come from the
model's own declarations (:func:`megazero.checkpoint.offline.declarations`), so a missing or extra
tensor is refused, never initialised or dropped.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from megazero.checkpoint.finite import listed, nonfinite_names
from megazero.checkpoint.hf_tokenizer import SpecialTokens, write_tokenizer
from megazero.checkpoint.offline import check_shapes, declarations
from megazero.config import DataConfig, ModelConfig
from megazero.errors import CheckpointError, ConfigError
from megazero.spec import ModelSpec, get_model_spec, spec_for_hf

DEFAULT_MAX_SHARD_BYTES = 5 * 10 ** 9       # save_pretrained's default "5GB"
INDEX = "model.safetensors.index.json"


def adapter_of(cfg: ModelConfig):
    """The HF adapter of a model's family; refused when the family has none."""
    spec = get_model_spec(cfg.model_family)
    if spec.hf is None:
        raise CheckpointError(f"model family {spec.name!r} has no HuggingFace format: it cannot be exported")
    return spec.hf


def model_config_from_hf(hf: dict, seq_length: int | None = None) -> ModelConfig:
    """The megazero ModelConfig of an HF config dict (by its ``model_type``; GPT-2 when absent), with
    ``model_family`` naming the family that reads it."""
    try:
        spec: ModelSpec = spec_for_hf(hf.get("model_type", "gpt2"))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    return dataclasses.replace(spec.hf.config_from_hf(hf, seq_length), model_family=spec.name)


def save_hf(out_dir: str | os.PathLike, tensors: dict[str, torch.Tensor], cfg: ModelConfig,
            dtype: torch.dtype = torch.float32, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
            data_cfg: DataConfig | None = None) -> Path:
    """Write ``config.json`` + safetensors loadable by ``AutoModelForCausalLM.from_pretrained``, and the
    run's tokenizer files when it is known, loadable by ``AutoTokenizer`` with the same ids
    (:func:`megazero.checkpoint.hf_tokenizer.write_tokenizer`; its bos/eos ids go into ``config.json``)."""
    out, adapter = Path(out_dir), adapter_of(cfg)
    config = adapter.hf_config(cfg)                   # refuses what the format cannot express, before writing
    out.mkdir(parents=True, exist_ok=True)
    special = write_tokenizer(data_cfg, out, cfg.max_position_embeddings) if data_cfg is not None else SpecialTokens()
    config.update(bos_token_id=special.bos, eos_token_id=special.eos, torch_dtype=str(dtype).removeprefix("torch."))
    state = {k: v.to(dtype).contiguous() for k, v in adapter.to_hf_state(tensors, cfg).items()}
    write_safetensors(out, state, max_shard_bytes)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out


def write_safetensors(out: Path, state: dict[str, torch.Tensor], max_shard_bytes: int) -> list[str]:
    """``model.safetensors``, or shards of at most ``max_shard_bytes`` (a larger tensor gets a shard of
    its own) in the state's order plus the index; returns the file names."""
    sizes = {k: t.numel() * t.element_size() for k, t in state.items()}
    if sum(sizes.values()) <= max_shard_bytes:
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    shards, size = [[]], 0
    for name, nbytes in sizes.items():
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files, weight_map = [], {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: state[k] for k in names}, str(out / file), metadata={"format": "pt"})
        files.append(file)
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=2))
    return files + [INDEX]


def _load_safetensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except Exception as e:  # noqa: BLE001 - safetensors' own error type: a truncated or damaged file
        raise CheckpointError(f"{file} cannot be read as safetensors ({str(e).splitlines()[0]}): the file is "
                              f"truncated or corrupted; download or write it again") from None


def _load_torch_file(file: Path) -> dict[str, torch.Tensor]:
    """A ``pytorch_model.bin`` of plain tensors (``weights_only``: no Python object is ever built);
    one that holds anything else is refused, not unpickled."""
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - UnpicklingError, a zip or EOF error: never a traceback
        import pickle

        text = str(e).strip()
        why = ("it holds pickled Python objects besides tensors" if isinstance(e, pickle.UnpicklingError)
               or "Weights only load failed" in text else (text.splitlines() or [type(e).__name__])[0][:200])
        raise CheckpointError(f"{file} cannot be read as plain tensors ({why}): megazero does not unpickle "
                              f"Python objects; save the model as safetensors (save_pretrained(..., "
                              f"safe_serialization=True)) and convert that") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{file} holds {type(state).__name__}, not a state dict of tensors: save the model "
                              f"as safetensors and convert that")
    return state


def _read_json(file: Path, what: str) -> dict:
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON ({e}): {what}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} holds {type(data).__name__}, not a JSON object: {what}")
    return data


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory: ``model.safetensors``, sharded safetensors (``INDEX``), or
    ``pytorch_model.bin`` (single or sharded), the latter read with ``torch.load(weights_only=True)``."""
    for index_name, load in ((INDEX, _load_safetensors), ("pytorch_model.bin.index.json", _load_torch_file)):
        if (path / index_name).is_file():
            weight_map = _read_json(path / index_name, "write the index again").get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{path / index_name} has no weight_map: write the index again")
            state = {}
            for file in sorted(set(map(str, weight_map.values()))):
                if not (path / file).is_file():
                    raise CheckpointError(f"{path / index_name} names {file}, which is missing")
                state.update(load(path / file))
            return state
    if (path / "model.safetensors").is_file():
        return _load_safetensors(path / "model.safetensors")
    if (path / "pytorch_model.bin").is_file():
        return _load_torch_file(path / "pytorch_model.bin")
    raise CheckpointError(f"{path} has no model.safetensors, {INDEX} or pytorch_model.bin")


def persistent_buffers(cfg: ModelConfig) -> set[str]:
    """The names of the model's persistent buffers (state that is not a parameter), from a meta build."""
    model = get_model_spec(cfg.model_family).build_full(cfg, device="meta")
    return set(model.state_dict()) - {name for name, _ in model.named_parameters()}


def load_hf(path: str | os.PathLike, seq_length: int | None = None,
            settings: dict | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, megazero whole tensors) of an HF directory a registered family reads (GPT-2,
    Llama, Mistral, Qwen2 for the GPT family); every tensor of the model must be there and nothing else.
    ``settings``: model config fields the HF config does not hold, set before the tensors are mapped
    (``{"apply_layernorm_1p": True}``: the norm weights stored zero-centred)."""
    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path} is missing: --input must be an HF model directory")
    hf = _read_json(config_path, "--input must hold an HF model's config.json")
    try:
        cfg = model_config_from_hf(hf, seq_length)
    except (KeyError, TypeError, ValueError) as e:        # a config.json missing or mistyping a field
        raise CheckpointError(f"{config_path} is not a usable model config ({type(e).__name__}: {e}): "
                              f"fix config.json") from None
    cfg = dataclasses.replace(cfg, **(settings or {}))
    weights = read_weights(path)
    damaged = nonfinite_names(weights.items())
    if damaged:
        raise CheckpointError(f"{path} holds NaN or inf values in {listed(damaged)}: a model cannot be trained or "
                              f"run from them; convert an intact copy of the weights")
    try:
        tensors = adapter_of(cfg).from_hf_state(weights, cfg)
    except (KeyError, RuntimeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{path}: the weights do not fit {config_path} ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}): the config does not describe "
                              f"these weights") from None
    decls = declarations(cfg)
    expected = set(decls) | persistent_buffers(cfg)          # buffers: an MoE router's expert bias
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise CheckpointError(f"{path}: tensors missing {missing[:5]} / unexpected {extra[:5]} for this "
                              f"{cfg.num_layers}-layer model")
    check_shapes(tensors, cfg, decls, source=f"{path} against its config.json")
    return cfg, tensors
