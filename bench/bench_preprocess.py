"""Preprocessing throughput (MB/s, 1 and 2 workers) and peak memory at two input sizes.

    python -m bench.bench_preprocess [--sizes-mb 5 20] [--workers 1 2] [--vocab-dir ../shared/data/gpt2]

The corpus is the embedded 1 MB Jargon File as JSON lines (one lexicon entry per line), repeated to
the requested size. Each run is a fresh process (``--child``), so its peak RSS (``ru_maxrss``) is its
own; with workers, the largest worker's peak is reported too, and CPU seconds of the main process
and of the workers show whether a slow parallel run lacked cores (busy machine) or did extra work. Also prints the raw encode speed of
the two GPT-2 BPE libraries on the (unrepeated) 1 MB text, which is why tiktoken backs
``GPT2BPETokenizer``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def make_corpus(path: Path, size_mb: float) -> int:
    from megazero.data.sample import sample_documents
    lines = [json.dumps({"text": d}) + "\n" for d in sample_documents()]
    written, target = 0, int(size_mb * 1e6)
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            for line in lines:
                f.write(line)
                written += len(line.encode("utf-8"))
                if written >= target:
                    break
    return written


def _hwm_mb(pid="self") -> float:
    """Peak resident memory (VmHWM) of a live process, in MB; 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def child(args) -> None:
    """One measured run. VmHWM is per address space (reset by exec), unlike ru_maxrss, which Linux
    carries over from the parent that forked us."""
    import multiprocessing as mp
    import threading

    from megazero.data.preprocess import PreprocessConfig, preprocess
    peaks: dict[int, float] = {}
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            for c in mp.active_children():
                peaks[c.pid] = max(peaks.get(c.pid, 0.0), _hwm_mb(c.pid))
            stop.wait(0.02)
    threading.Thread(target=watch, daemon=True).start()
    cfg = PreprocessConfig(input=args.input, output_prefix=args.output, tokenizer_type="GPT2BPETokenizer",
                           vocab_file=os.path.join(args.vocab_dir, "vocab.json"),
                           merge_file=os.path.join(args.vocab_dir, "merges.txt"),
                           append_eod=True, workers=args.workers, log_interval=0,
                           overwrite=True)          # every run writes the same scratch prefix
    import resource
    res = preprocess(cfg, log=lambda s: None)
    stop.set()
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    print(json.dumps({"cpu_main": me.ru_utime + me.ru_stime, "cpu_workers": kids.ru_utime + kids.ru_stime,"mb": res.bytes_read / 1e6, "seconds": res.seconds, "docs": res.documents,
                      "tokens": res.tokens, "rss_main_mb": _hwm_mb(),
                      "rss_worker_mb": max(peaks.values(), default=0.0)}))


def run_child(inp: Path, out: Path, workers: int, vocab_dir: str) -> dict:
    cmd = [sys.executable, "-m", "bench.bench_preprocess", "--child", "--input", str(inp), "--output", str(out),
           "--workers", str(workers), "--vocab-dir", vocab_dir]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(res.stdout.strip().splitlines()[-1])


def tokenizer_speeds(vocab_dir: str) -> None:
    from megazero.data.sample import sample_text
    from megazero.data.tokenizers import GPT2BPETokenizer
    text = sample_text()
    mb = len(text.encode("utf-8")) / 1e6
    for backend in ("tiktoken", "tokenizers"):
        tok = GPT2BPETokenizer(os.path.join(vocab_dir, "vocab.json"), os.path.join(vocab_dir, "merges.txt"), backend)
        best = min(_timed(tok.tokenize, text) for _ in range(3))
        print(f"encode 1 MB, one thread, {backend:10s}: {mb / best:6.2f} MB/s")


def _timed(fn, arg) -> float:
    t = time.perf_counter()
    fn(arg)
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[5, 20])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=3, help="runs per setting; the best is reported")
    p.add_argument("--vocab-dir", default=str(REPO.parent / "shared" / "data" / "gpt2"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--input", help=argparse.SUPPRESS)
    p.add_argument("--output", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.workers = args.workers[0]
        return child(args)
    if not os.path.isfile(os.path.join(args.vocab_dir, "vocab.json")):
        raise SystemExit(f"--vocab-dir {args.vocab_dir}: no vocab.json/merges.txt there")
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
          f"GPT-2 BPE, --append-eod, jsonl input; best of {args.repeats} runs")
    tokenizer_speeds(args.vocab_dir)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = Path(tmp) / "tiny.jsonl"
        tiny.write_text(json.dumps({"text": "hello"}) + "\n")
        for w in args.workers:
            fixed = min(run_child(tiny, Path(tmp) / "out", w, args.vocab_dir)["seconds"] for _ in range(args.repeats))
            print(f"fixed cost (1-line input), workers={w}: {fixed:.2f} s (tokenizer load, worker start-up)")
        for size in args.sizes_mb:
            inp = Path(tmp) / f"corpus_{size:g}mb.jsonl"
            nbytes = make_corpus(inp, size)
            for w in args.workers:
                runs = [run_child(inp, Path(tmp) / "out", w, args.vocab_dir) for _ in range(args.repeats)]
                r = min(runs, key=lambda x: x["seconds"])
                print(f"{nbytes / 1e6:6.1f} MB  workers={w}  {r['mb'] / r['seconds']:6.2f} MB/s  "
                      f"({r['docs']:,} docs, {r['tokens']:,} tokens, {r['seconds']:.2f} s)  "
                      f"CPU s main {r['cpu_main']:.2f} workers {r['cpu_workers']:.2f}  "
                      f"peak RSS main {r['rss_main_mb']:.0f} MB" +
                      (f", per worker {r['rss_worker_mb']:.0f} MB" if w > 1 else ""))


if __name__ == "__main__":
    main()
