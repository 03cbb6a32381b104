"""megazero's benchmarks: the trainer's step beside its peers, each written as its users write it,
with the formulas and floors beside the measurements. Run from the repository root as
``python -m bench.run`` (docs/benchmarks.md); the modules here import each other as ``bench.<module>``.

Layering (tests/test_layering.py): no import cycle among these modules, no module importing another's
underscore name, no ``sys.path`` edits, nothing from ``tests``. ``common`` (spec, data, launcher, timing
loop, theory) and ``steps`` (one training step per framework) are the base every row module builds on;
``report`` and ``run`` sit on top.
"""
