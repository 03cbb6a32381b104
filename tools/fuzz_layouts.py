"""Fuzz the layout space: draw layouts, train each against its serial twin, resume under a second layout.

    python -m tools.fuzz_layouts --draws 30 --seed 1000            # draws 1000..1029, on CPU processes
    python -m tools.fuzz_layouts --seed 1017 --draws 1             # reproduce one draw (printed on failure)
    python -m tools.fuzz_layouts --draws 300 --seed 0 --dry-run    # the draws and their coverage, no training
    python -m tools.fuzz_layouts --draws 1000 --seed 2000 --minutes 70 --results r.jsonl   # as many as fit
    python -m tools.fuzz_layouts --draws 300 --seed 0 --candidates 8 --dry-run   # each draw the most covering of 8

Draw ``i`` of a campaign is seeded ``--seed + i``, so any draw reruns alone; with ``--candidates K`` it is
the one of seeds ``--seed + K i`` .. ``--seed + K i + K - 1`` that adds the most pairs of axis values not
yet covered (each line names the seed chosen). The summary gives the axes
covered, the pairs of axis values covered (against the pairs the configuration rules allow, estimated
from validated samples) and the failures, each with its one-line reproduction. Exit status 1 when a
draw failed. docs/fuzzing.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

try:
    from tools.fuzz.checker import check, unusable_workdir
    from tools.fuzz.coverage import Coverage, allowed_pairs, most_covering
    from tools.fuzz.launch import DEFAULT_LAUNCHER, LAUNCHER_HELP, LAUNCHERS
except ModuleNotFoundError as missing:        # run as a file, where `tools` does not import
    if missing.name != "tools":
        raise
    sys.exit("tools/fuzz_layouts.py is part of the tools package: run it from the repository root as "
             "python -m tools.fuzz_layouts ...")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fuzz_layouts.py", description=__doc__.split("\n")[0])
    p.add_argument("--draws", type=int, default=10, help="draws to check (default 10)")
    p.add_argument("--seed", type=int, default=0, help="the first draw's seed; draw i is seeded seed + i")
    p.add_argument("--workdir", help="where the runs go (default: a temporary directory); a failing draw's "
                                     "runs are kept there")
    p.add_argument("--results", help="append one JSON line per draw to this file")
    p.add_argument("--reference-samples", type=int, default=2000,
                   help="validated layouts drawn to estimate the allowed pairs (0: no pairwise estimate)")
    p.add_argument("--candidates", type=int, default=1,
                   help="choose each draw among this many seeds, the one covering the most new pairs (default 1)")
    p.add_argument("--launcher", choices=sorted(LAUNCHERS), default=DEFAULT_LAUNCHER, help=LAUNCHER_HELP)
    p.add_argument("--dry-run", action="store_true", help="draw and report coverage only; train nothing")
    p.add_argument("--minutes", type=float, help="start no draw after this many minutes (a campaign sized by "
                                                 "the time the machine gives); the summary covers the draws run")
    args = p.parse_args(argv)
    problem = refusal(args)
    if problem:
        p.error(problem)

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="megazero-fuzz-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cov, failures, start, done = Coverage(), [], time.monotonic(), 0
    for i in range(args.draws):
        if args.minutes is not None and time.monotonic() - start > 60 * args.minutes:
            break
        k = args.candidates
        d, done = most_covering(range(args.seed + k * i, args.seed + k * (i + 1)), cov), i + 1
        cov.add(d)
        if args.dry_run:
            print(f"draw {d.seed}: {d.world} ranks: {d.describe()} | resumed on {d.resume_world}: "
                  f"{d.describe('resume')}", flush=True)
            continue
        t0 = time.monotonic()
        report = check(d, workdir, LAUNCHERS[args.launcher])
        print(f"[{i + 1}/{args.draws} {time.monotonic() - start:.0f}s] {report.summary()}", flush=True)
        if not report.ok:
            print(report.step_table(), flush=True)
            failures.append(report)
        if args.results:
            with open(args.results, "a") as f:
                f.write(json.dumps({"seed": d.seed, "ok": report.ok, "error": report.error, "seconds":
                                    round(time.monotonic() - t0, 1), "world": d.world, "resume_world": d.resume_world,
                                    "first": d.describe(), "resume": d.describe("resume"),
                                    "first_difference": str(report.first_difference or "")}) + "\n")
    allowed = allowed_pairs(args.reference_samples) if args.reference_samples else None
    print("\n" + cov.describe(allowed))
    verb = "drawn" if args.dry_run else "checked"
    print(f"\n{done} draws {verb} (seeds {args.seed}..{args.seed + args.candidates * done - 1}"
          f"{f', each the most covering of {args.candidates}' if args.candidates > 1 else ''}) in "
          f"{time.monotonic() - start:.0f} s; failures: {len(failures)}")
    for r in failures:
        print(f"  seed {r.draw.seed}: {r.first_difference or r.error}\n    reproduce: "
              f"python -m tools.fuzz_layouts --seed {r.draw.seed} --draws 1")
    return 1 if failures else 0


def refusal(args: argparse.Namespace) -> str | None:
    """Why the campaign's arguments cannot run as given (a count that is not positive, a time limit that
    starts no draw, a work directory or results file that cannot be written), said before any draw; or None."""
    for name in ("draws", "candidates"):
        if getattr(args, name) < 1:
            return f"--{name} must be >= 1, got {getattr(args, name)}"
    if args.reference_samples < 0:
        return f"--reference-samples must be >= 0 (0: no pairwise estimate), got {args.reference_samples}"
    if args.minutes is not None and not args.minutes > 0:
        return f"--minutes must be > 0 (the time within which draws start), got {args.minutes}"
    problem = unusable_workdir(args.workdir)
    if problem or args.results is None:
        return problem
    if args.dry_run:
        return "--results records checked draws and --dry-run checks none: drop one of them"
    results = Path(args.results)
    if results.is_dir():
        return f"--results {args.results} is a directory: give a file (one JSON line per draw is appended)"
    folder = results.parent if str(results.parent) else Path(".")
    if not folder.is_dir():
        return f"--results {args.results}: the folder {folder} does not exist: create it or give another path"
    if not os.access(results if results.exists() else folder, os.W_OK):
        return f"--results {args.results} is not writable: give a file you can write"
    return None


if __name__ == "__main__":
    sys.exit(main())
