"""Single-process programs over the library (data, checkpoints, the model spec, the trainer's flags), run
from the repository as ``python -m tools.<name>``; ``fuzz/`` holds the layout fuzzer."""
