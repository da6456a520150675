"""kvlab's zero-context decode step at two or more commits, each in a process of its own, taking turns: a regression
between commits told apart from the machine's drift.

    python benchmarks/tree_ab.py abeb7d8 HEAD           # 30 rounds, one thread, cpu-small: about 5 minutes
    python benchmarks/tree_ab.py abeb7d8 HEAD . --keep  # '.': the working tree as it is; one process per tree
    python benchmarks/tree_ab.py HEAD . --runtime onnx-packed  # Decoder's runtime in every tree (.[onnx])

Each revision's ``kvlab/`` is exported with ``git archive`` into a temporary directory; a directory that holds a
``kvlab/`` package is used as it is. A sample is a new Python process, which imports that tree's kvlab (the table
says from where), sets torch's threads, builds the model with its seeded random weights, and times five bursts of
decode steps from an empty cache; the sample is their median step, on the wall clock and on the thread clock. A
round takes one sample of every tree in turn, in the reverse order every other round.

Why this shape: a step's time drifts by a fifth over minutes on a shared machine, so two trees timed one after
the other show a "regression" either way; taking turns puts both under the same conditions, and the ratio to the
first tree is the median of each round's ratio, so drift slower than a round cancels. And each process carries a
bias of its own that lasts as long as it does (where its weights landed in memory): six processes of one and the
same tree, kept for 30 rounds, differed by up to 6%, one beating another in 27 of 30 rounds
(docs/cpu_performance.md, section J). A new process per sample averages that out. ``--keep`` keeps one process
per tree instead: five times faster, and good for differences well above that bias.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FRESH_BURSTS = 5


def child(tree: str, preset: str, threads: int, steps: int, runtime: str) -> None:
    """Runs in a tree's own process: ``ready <kvlab path>``, then ``<wall ms> <thread ms>`` for each line read."""
    sys.path.insert(0, tree)
    import torch

    torch.set_num_threads(threads)
    import kvlab

    if not Path(kvlab.__file__).resolve().is_relative_to(Path(tree).resolve()):
        sys.exit(f"kvlab was imported from {kvlab.__file__}, not from the tree {tree}")
    if not (hasattr(kvlab, "Decoder") and hasattr(kvlab, "get_model")):
        sys.exit("its kvlab has no kvlab.Decoder and kvlab.get_model: a revision older than this script can time")
    try:
        # Passed only when asked for: revisions from before Decoder had a runtime time their eager step.
        model = kvlab.Decoder(
            kvlab.get_model(preset), device="cpu", **({} if runtime == "eager" else {"runtime": runtime})
        )
    except (TypeError, ValueError) as e:
        sys.exit(f"--runtime {runtime}: this tree's Decoder refused it: {e}")
    model.eval()
    token = torch.zeros(1, 1, dtype=torch.long)

    def burst() -> tuple[float, float]:
        wall, cpu = [], []
        with torch.inference_mode():
            cache = model.new_cache(1, steps)
            for _ in range(steps):
                w0, c0 = time.perf_counter(), time.thread_time()
                model.decode_step(token, cache)
                wall.append(time.perf_counter() - w0)
                cpu.append(time.thread_time() - c0)
        # The first step of a burst follows the parent's pause; the rest are back to back.
        return statistics.median(wall[1:]) * 1e3, statistics.median(cpu[1:]) * 1e3

    for _ in range(3):
        burst()
    print("ready", kvlab.__file__, flush=True)
    for _ in sys.stdin:
        print("{:.4f} {:.4f}".format(*burst()), flush=True)


@dataclass
class Tree:
    """One revision or directory, where its kvlab lives, and its samples: (wall ms, thread ms) per round."""

    name: str
    commit: str
    path: Path
    kvlab_file: str = ""
    samples: list[tuple[float, float]] = field(default_factory=list)


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True)


def prepare(spec: str, workdir: Path, parser: argparse.ArgumentParser) -> Tree:
    """A directory holding a kvlab package as it is; otherwise a git revision's ``kvlab/``, exported to workdir."""
    if Path(spec).is_dir():
        if not (Path(spec) / "kvlab" / "__init__.py").is_file():
            parser.error(
                f"tree {spec!r}: the directory holds no kvlab/ package; allowed: a git revision, or a checkout"
            )
        return Tree(spec, "dir", Path(spec).resolve())
    if os.sep in spec or Path(spec).exists():
        what = "not a directory" if Path(spec).exists() else "no such directory"
        parser.error(f"tree {spec!r}: {what}; allowed: a git revision, or a directory holding kvlab/")
    if shutil.which("git") is None:
        parser.error(f"tree {spec!r}: git is not on PATH, so revisions cannot be read; allowed: directories")
    found = git("rev-parse", "--verify", "--quiet", f"{spec}^{{commit}}")
    if found.returncode:
        parser.error(
            f"tree {spec!r}: not a commit in {REPO}; allowed: a revision (HEAD, abeb7d8, main~3) or a directory"
        )
    commit = found.stdout.decode().strip()
    archive = git("archive", "--format=tar", commit, "kvlab")
    if archive.returncode:
        parser.error(f"tree {spec!r}: git archive failed: {archive.stderr.decode().strip()}")
    path = workdir / commit[:12]
    if not path.exists():
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            # The "data" filter refuses absolute paths and links out of the folder (Python >= 3.10.12).
            tar.extractall(path, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return Tree(spec, commit[:9], path)


class Runner:
    """A tree's process: started afresh for every sample, or kept for the whole run (``--keep``)."""

    def __init__(self, tree: Tree, args: argparse.Namespace) -> None:
        self.tree, self.args, self.proc = tree, args, None
        if args.keep:
            self.proc = self._start()

    def _start(self) -> subprocess.Popen:
        a = self.args
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(self.tree.path), "--model", a.model]
        proc = subprocess.Popen(
            [*cmd, "--threads", str(a.threads), "--steps", str(a.steps), "--runtime", a.runtime],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tempfile.gettempdir(),  # not this checkout, whose kvlab/ would be found first
        )
        line = proc.stdout.readline()
        if not line.startswith("ready "):
            proc.kill()
            err = proc.stderr.read().strip().splitlines()
            sys.exit(f"tree {self.tree.name!r} ({self.tree.commit}) did not start: {err[-1] if err else 'no output'}")
        self.tree.kvlab_file = line.split(" ", 1)[1].strip()
        return proc

    def sample(self) -> tuple[float, float]:
        if self.proc is not None:
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
            return tuple(float(v) for v in self.proc.stdout.readline().split())
        proc = self._start()
        out, _ = proc.communicate("go\n" * FRESH_BURSTS)
        bursts = [tuple(float(v) for v in line.split()) for line in out.splitlines()]
        return statistics.median(b[0] for b in bursts), statistics.median(b[1] for b in bursts)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait()


def report(trees: list[Tree], args: argparse.Namespace) -> list[str]:
    mode = "one process per tree" if args.keep else "a new process per sample"
    lines = [
        f"{args.cfg.name}, runtime {args.runtime}, decode steps from an empty cache (context 0-{args.steps - 1}), "
        f"{args.threads} torch "
        f"thread{'s' if args.threads > 1 else ''}, {args.rounds} round{'s' if args.rounds > 1 else ''}; a sample: "
        f"{'one burst' if args.keep else f'the median of {FRESH_BURSTS} bursts'} of {args.steps} steps, {mode}"
    ]
    lines += [f"  {t.name}: kvlab from {t.kvlab_file}" for t in trees]
    lines.append("  (revisions are exported to a temporary folder, removed when the run ends)")
    width = max(len(t.name) for t in trees) + 2
    head = f"{'tree':<{width}}{'commit':<11}{'wall ms':>9}{'wall min-max':>15}{'thread ms':>11}{'/ first':>9}"
    head += "  slower rounds"
    lines.append(head)
    first = trees[0]
    for t in trees:
        wall = [s[0] for s in t.samples]
        ratios = [b[0] / a[0] for a, b in zip(first.samples, t.samples, strict=True)]
        slower = "-" if t is first else f"{sum(r > 1 for r in ratios)}/{len(ratios)}"
        spread = f"{min(wall):.2f}-{max(wall):.2f}"
        thread = statistics.median(s[1] for s in t.samples)
        lines.append(
            f"{t.name:<{width}}{t.commit:<11}{statistics.median(wall):>9.2f}{spread:>15}{thread:>11.2f}"
            f"{statistics.median(ratios):>9.3f}  {slower}"
        )
    lines.append(
        "wall ms, thread ms: a tree's median sample on the wall clock and on its thread's CPU clock. / first: the "
        "median over rounds of the tree's sample over the first tree's in the same round (so not the ratio of the "
        "two medians); slower rounds: how many of those ratios exceed 1. A regression shows in both; drift slower "
        "than a round shows in neither."
    )
    if args.keep:
        lines.append(
            "With --keep, a process's own bias shows in both too: the same code in two kept processes differed by up "
            "to 6%, one winning 27 of 30 rounds (docs/cpu_performance.md, section J). Give the same revision twice "
            "(HEAD HEAD~0) to see that bias here, or run without --keep."
        )
    if args.rounds < 10:
        lines.append(
            f"{args.rounds} round{'s' if args.rounds > 1 else ''}: too few to tell a few percent from noise; section J "
            "resolves 4-7% with 16 rounds."
        )
    return lines


def parse(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("trees", nargs="*", help="git revisions or kvlab checkouts ('.': this working tree)")
    parser.add_argument(
        "--model", default="cpu-small", help="a small runnable preset every tree knows (default cpu-small)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument(
        "--runtime", default="eager", help="Decoder's runtime in every tree (default eager; e.g. onnx, onnx-packed)"
    )
    parser.add_argument("--rounds", type=int, default=30, help="turns each tree takes (default 30)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per burst (default 16)")
    parser.add_argument("--keep", action="store_true", help="one process per tree, kept: faster, biased by the process")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name, low in (("threads", 1), ("rounds", 1), ("steps", 2)):
        if getattr(args, name) < low:
            parser.error(f"--{name}: {getattr(args, name)}; allowed: an integer >= {low}")
    if args.child is None:
        if len(args.trees) < 2:
            parser.error(
                f"trees: {len(args.trees)} given; allowed: two or more (the first is the one compared against)"
            )
        repeated = sorted({t for t in args.trees if args.trees.count(t) > 1})
        if repeated:
            # The report names each tree by what was given: two rows of one name could not be told apart.
            parser.error(
                f"trees: {', '.join(repeated)} given twice; allowed: distinct names (to time a revision against "
                "itself, name it twice differently: HEAD HEAD~0)"
            )
        args.cfg = runnable_preset(args.model, parser)
    return parser, args


def runnable_preset(name: str, parser: argparse.ArgumentParser):
    """``--model`` as a preset this checkout runs, refused by name before any tree is exported. (A tree from before
    the preset existed says so when its process starts.)"""
    # Imported here, not at the top: a child process must import its own tree's kvlab first.
    from kvlab.roofline import param_count
    from kvlab.spec.presets import get_model, model_presets

    runnable = ", ".join(n for n, c in model_presets().items() if c.runnable and param_count(c) < 1e9)
    try:
        cfg = get_model(name, "--model")
    except ValueError:
        parser.error(f"--model: unknown preset {name!r}; allowed: {runnable}")
    if not cfg.runnable:
        parser.error(f"--model: {cfg.name} cannot run: {cfg.not_runnable_reason}; allowed: {runnable}")
    if param_count(cfg) >= 1e9:
        # Every sample builds the model afresh in a process of its own: billions of random weights each time.
        parser.error(f"--model: {cfg.name} has {param_count(cfg) / 1e9:.1f}B parameters; allowed: {runnable}")
    return cfg


def main(argv: list[str] | None = None) -> None:
    parser, args = parse(argv)
    if args.child is not None:
        child(args.child, args.model, args.threads, args.steps, args.runtime)
        return
    with tempfile.TemporaryDirectory(prefix="kvlab-tree-ab-") as workdir:
        trees = [prepare(spec, Path(workdir), parser) for spec in args.trees]
        load = f", load average {os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else ""
        print(f"{sys.platform}, {os.cpu_count()} logical CPUs, Python {sys.version.split()[0]}{load}", flush=True)
        runners = [Runner(t, args) for t in trees]
        try:
            for r in range(args.rounds):
                for runner in runners if r % 2 == 0 else runners[::-1]:
                    runner.tree.samples.append(runner.sample())
        finally:
            for runner in runners:
                runner.close()
    print("\n".join(report(trees, args)))


if __name__ == "__main__":
    main()
