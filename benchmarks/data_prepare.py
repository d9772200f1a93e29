"""`gwtf data prepare` on a generated jsonl corpus: wall time, tokens/s per core, peak RSS, and the
time of the second run, which must reuse the prepared tokens.

Usage: `python benchmarks/data_prepare.py [--mb 1024] [--files 1] [--tokenizer bpe] [--workers 0]
[--dir TMP] [--out results.json]`. The corpus is `--files` jsonl files of `--mb` MB in all (one
record per line, {"id": n, "text": ...}; the text is Zipf-distributed pseudo-words from a seeded
generator, 50 to 600 words a record), written into a temporary folder that is removed afterwards.
`gwtf data prepare` runs twice as a subprocess (`python -m gwtf`, a private cache); peak RSS is
`getrusage(RUSAGE_CHILDREN).ru_maxrss`: the largest single process of that run (the command or
one of its spawned workers). tokens/s per core is tokens / tokenizing wall time / workers (lower
when other work shares the cores); tokens_per_cpu_s divides by the CPU time the run used instead. The reference is the tokenizer's own batch encoder on one core
(`tokenizers` `encode_batch`, TOKENIZERS_PARALLELISM=false) over the first 16 MB of the records.
Targets (issue 41): peak RSS under 1 GB at 1 GB of input; the second run under 5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MB = 1 << 20


def _vocabulary(rng: np.random.Generator, n: int = 50_000) -> list[str]:
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    weights = 1.0 / np.arange(1, len(letters) + 1)
    weights /= weights.sum()
    lengths = rng.integers(1, 11, size=n)
    return ["".join(rng.choice(letters, size=k, p=weights)) for k in lengths.tolist()]


def write_corpus(folder: Path, total_bytes: int, files: int, seed: int = 0) -> list[Path]:
    """`files` jsonl files of about total_bytes / files bytes each."""
    rng = np.random.default_rng(seed)
    vocab = _vocabulary(rng)
    p = 1.0 / np.arange(1, len(vocab) + 1) ** 1.07
    p /= p.sum()
    folder.mkdir(parents=True, exist_ok=True)
    paths, record = [], 0
    for i in range(files):
        path = folder / f"part-{i:04d}.jsonl"
        size = 0
        with open(path, "w", encoding="utf-8") as f:
            while size < total_bytes // files:
                words = [vocab[j] for j in rng.choice(len(vocab), size=200_000, p=p).tolist()]
                cuts = np.cumsum(rng.integers(50, 601, size=2000)).tolist()
                lines = []
                for a, b in zip([0, *cuts], cuts):
                    if b > len(words):
                        break
                    lines.append(json.dumps({"id": record, "text": " ".join(words[a:b]) + "."}) + "\n")
                    record += 1
                chunk = "".join(lines)
                f.write(chunk)
                size += len(chunk)
        paths.append(path)
    return paths


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _prepare(corpus: Path, cache: Path, tokenizer: str, workers: int) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes of the largest child so far, output) of one `gwtf data prepare`."""
    cmd = [sys.executable, "-m", "gwtf", "data", "prepare", str(corpus), "--set", f'data.cache_dir="{cache}"',
           "--set", f'data.tokenizer="{tokenizer}"', "--set", f"data.prepare_workers={workers}"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        sys.exit(f"gwtf data prepare failed ({proc.returncode}):\n{proc.stderr}")
    return wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, proc.stdout + proc.stderr


def _reference_tokens_per_s(corpus: Path, manifest: dict, cache: Path) -> float:
    """One core of `tokenizers` batch encoding over the first 16 MB of texts."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    name = manifest["tokenizer"]["file"]
    if not name:
        return float("nan")
    tok = Tokenizer.from_file(str(cache / "files" / name))
    texts, size = [], 0
    with open(sorted(corpus.glob("*.jsonl"))[0], encoding="utf-8") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            size += len(line)
            if size > 16 * MB:
                break
    t0 = time.monotonic()
    n = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    return n / (time.monotonic() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=1024, help="corpus size in MB (MiB)")
    ap.add_argument("--files", type=int, default=1, help="number of jsonl files")
    ap.add_argument("--tokenizer", default="bpe", help='data.tokenizer ("bpe", "byte" or a path)')
    ap.add_argument("--workers", type=int, default=0, help="data.prepare_workers (0: one per core)")
    ap.add_argument("--dir", default=None, help="where the temporary folder goes (default: the system's)")
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gwtf-bench-prepare-", dir=args.dir))
    try:
        t0 = time.monotonic()
        write_corpus(tmp / "corpus", args.mb * MB, args.files)
        gen_s = time.monotonic() - t0
        corpus_bytes = sum(p.stat().st_size for p in (tmp / "corpus").iterdir())
        cpu0 = _children_cpu_s()
        first_s, rss, _ = _prepare(tmp / "corpus", tmp / "cache", args.tokenizer, args.workers)
        cpu_s = _children_cpu_s() - cpu0
        manifest = json.loads(next((tmp / "cache" / "files").glob("prepared-*/manifest.json")).read_text())
        second_s, _, second_out = _prepare(tmp / "corpus", tmp / "cache", args.tokenizer, args.workers)
        timing = manifest["timing_s"]
        workers = timing["workers"]
        result = {
            "corpus_mb": corpus_bytes / MB, "files": args.files, "records": manifest["records"],
            "tokens": manifest["tokens"], "tokenizer": manifest["tokenizer"]["key"], "workers": workers,
            "cpu_count": os.cpu_count(), "generate_s": gen_s, "first_run_s": first_s,
            "tokenizer_s": timing["tokenizer"], "tokenize_s": timing["tokenize"], "write_s": timing["write"],
            "tokens_per_s_per_core": manifest["tokens"] / timing["tokenize"] / workers,
            # CPU time of the whole command and its workers (BPE training included): per core, however
            # busy the machine is with other work
            "first_run_cpu_s": cpu_s, "tokens_per_cpu_s": manifest["tokens"] / cpu_s,
            "reference_tokens_per_s_one_core": _reference_tokens_per_s(tmp / "corpus", manifest, tmp / "cache"),
            "peak_rss_mb": rss / MB, "second_run_s": second_s, "second_run_reused": "reused (unchanged)" in second_out,
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    width = max(len(k) for k in result)
    for key, value in result.items():
        print(f"{key:<{width}}  {value:,.3f}" if isinstance(value, float) else f"{key:<{width}}  {value}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
