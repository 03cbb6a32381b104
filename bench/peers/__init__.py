"""Peer training scripts written as their users write them (plain FSDP2, DDP, DeepSpeed) and the gloo
bandwidth probe, each run in its own processes under torchrun as a module from the repository root::

    torchrun --nproc-per-node 2 -m bench.peers.fsdp2 --steps 4

``plain`` holds what they share (shape flags, the model, the data, the timed loop)."""
