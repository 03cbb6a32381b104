"""Print what a megazero checkpoint holds and verify every file against its manifest.

    python tools/inspect_checkpoint.py ckpt/                 # the latest checkpoint under --save's dir
    python tools/inspect_checkpoint.py ckpt/iter_0000100 --no-verify

Prints the layout it was saved with, the iteration and train state, the model config, then every
tensor with its global shape, dtype and number of shards; then checks every file against its manifest
checksum, every shard against the tensor its file stores, and every model tensor's shape against the
saved model config. Exits 1 with one line if a file is missing or corrupted, or the index disagrees
with the files or the config.
"""
from __future__ import annotations

import argparse
import sys

from megazero.checkpoint import CheckpointReader
from megazero.checkpoint.format import optimizer_name
from megazero.checkpoint.offline import check_index_shapes, resolve
from megazero.errors import CheckpointError


def _optimizer_line(index: dict) -> str:
    """Which optimizer's state the checkpoint holds, at which step ("none (weights only)" without any)."""
    name = optimizer_name(index)
    return "none (weights only)" if name is None else f"{name}, step {index['optimizer']['step']}"


def describe(path: str, verify: bool = True) -> list[str]:
    directory = resolve(path)
    reader = CheckpointReader(directory, verify=verify)
    idx = reader.index
    lay, ts, model = idx["layout"], idx["train_state"], idx["job"]["model"]
    lines = [f"checkpoint {directory}",
             f"  saved with: tp {lay['tp']} pp {lay['pp']} dp {lay['dp']} (world {lay['world_size']}, "
             f"{lay['virtual_stages']} chunk(s)/rank, order {lay['order']}) zero stage {lay['zero_stage']}, "
             f"{lay['dtype']}",
             f"  iteration {ts['iteration']}, consumed samples {ts['consumed_samples']}, "
             f"skipped iterations {ts['skipped_iterations']}",
             f"  optimizer: {_optimizer_line(idx)}",
             "  model: " + ", ".join(f"{k}={model[k]}" for k in ("num_layers", "hidden_size", "num_attention_heads",
                                                                 "ffn_hidden_size", "vocab_size",
                                                                 "max_position_embeddings", "activation")),
             "  " + ", ".join(f"{k}={model[k]}" for k in ("position_embedding_type", "normalization", "swiglu",
                                                           "num_query_groups", "add_bias_linear")
                              if k in model)]
    numel = 0
    for name in sorted(reader.tensors):
        e = reader.tensors[name]
        lines.append(f"  {name:<60} {str(e['shape']):<16} {e['dtype']:<9} {len(e['shards'])} shard(s)")
        if name.startswith("model/"):
            n = 1
            for d in e["shape"]:
                n *= d
            numel += n
    lines.append(f"  {numel:,} model parameters")
    if verify:
        files = reader.verify_all()
        lines.append(f"  checksums OK: {len(files)} files")
        shards = reader.verify_shapes()
        models = check_index_shapes(reader)
        lines.append(f"  shapes OK: {shards} shards match their files, {models} model tensors match the model config")
    reader.close()
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="a save directory (uses its latest checkpoint) or an iter_* directory")
    p.add_argument("--no-verify", action="store_true", help="skip the size/sha256 checks")
    args = p.parse_args(argv)
    try:
        print("\n".join(describe(args.path, verify=not args.no_verify)))
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (KeyError, TypeError) as e:         # an index that lacks what every checkpoint records
        print(f"error: {args.path}: the checkpoint's index.json lacks {e} ({type(e).__name__}): it is corrupted",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
