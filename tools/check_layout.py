"""Check a planned run's layout before spending GPU hours: a scaled-down copy on CPU processes against its
serial twin.

    python -m tools.check_layout -- --tp 8 --pp 2 --dp 2 --sequence-parallel --num-layers 32 ...   # the plan's flags
    python -m tools.check_layout --world-size 32 -- --tp 8 --pp 2 ...                             # dp from the world

Every axis above 1 in the plan stays above 1 (sized 2), every switch is kept, and the model shrinks to
a few layers of tiny width (tools/fuzz/scale.py says exactly what changes). The copy trains two
iterations, saves, resumes under the same layout for two more; each iteration's loss, gradient norm and
every parameter and optimizer tensor are compared with the serial run of the same model, data and
initialisation. Prints "equal" or "NOT EQUAL" with the per-iteration differences and the first
iteration and tensor that differ; exit status 0, 1 (not equal or a run failed) or 2 (the plan's flags
are refused). docs/fuzzing.md.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from megazero.errors import ConfigError

try:
    from tools.fuzz.checker import check, unusable_workdir
    from tools.fuzz.launch import DEFAULT_LAUNCHER, LAUNCHER_HELP, LAUNCHERS
    from tools.fuzz.scale import scale_down
except ModuleNotFoundError as missing:        # run as a file, where `tools` does not import
    if missing.name != "tools":
        raise
    sys.exit("tools/check_layout.py is part of the tools package: run it from the repository root as "
             "python -m tools.check_layout ...")


def main(argv: list[str] | None = None, launch=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, plan = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else ([], argv)
    p = argparse.ArgumentParser(prog="check_layout.py", usage="check_layout.py [--world-size N] -- PLAN FLAGS...",
                                description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, help="the plan's number of processes, when its flags give no --dp")
    p.add_argument("--workdir", help="where the runs go (default: a temporary directory)")
    p.add_argument("--launcher", choices=sorted(LAUNCHERS), default=DEFAULT_LAUNCHER, help=LAUNCHER_HELP)
    args = p.parse_args(own)
    if args.world_size is not None and args.world_size < 1:
        p.error(f"--world-size must be >= 1, got {args.world_size}")
    problem = unusable_workdir(args.workdir)
    if problem:
        p.error(problem)
    try:
        d, notes = scale_down(plan, args.world_size)
    except ConfigError as e:
        print(f"check_layout.py: error: the plan is refused: {e}", file=sys.stderr)
        return 2
    for line in notes:
        print(line)
    print("scaled command: " + d.command())
    start = time.monotonic()
    report = check(d, Path(args.workdir or tempfile.mkdtemp(prefix="megazero-check-")), launch or LAUNCHERS[args.launcher],
                   reproduce="python -m tools.check_layout " + " ".join(own) + " -- " + " ".join(plan))
    print(report.summary().replace("draw 0: ", "layout check: ", 1))
    print(report.step_table())
    print(f"({time.monotonic() - start:.0f} s)")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
