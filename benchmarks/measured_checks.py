"""The false-failure loop: every measured graded check of a lesson, measured and checked again and again on the
solution's correct work in quick mode, to show that noise never fails correct work.

    python benchmarks/measured_checks.py 03_measuring_tpot 05_prefix_caching --runs 50
    python benchmarks/measured_checks.py --runs 10          # every lesson with a measured check
    python benchmarks/measured_checks.py 08_heavy_hitters 09_kv_quantization 10_speculative_decoding --runs 50

One kernel per lesson runs the solution notebook in quick mode up to its last measured check. Then, ``--runs`` times,
it runs again each measured check's span of cells: from the measurement cell that calls ``retake`` (which measures
again while the data is unreadable, at most ``TAKES`` times), or the timing cell named in ``START`` for a check
whose lesson times once, through the learner's answer to the check itself. A run
fails where any cell of the span raises. For each check the script prints failures / runs done, how many runs the check
said the effect was not seen (graded on the arithmetic alone), how many measurements the cell took, the wall time of
one span, and the load average over the loop: the goal is 0 failures in 50 runs on a machine that other jobs load.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from autograde.cli import checked_lessons  # noqa: E402 (the repository root is put on the path first)
from kvlab.machine.timing import load_average  # noqa: E402

# The graded checks that judge a measurement, by lesson: each grade id's span starts at the nearest code cell above it
# that measures through retake, or at the cell START names.
MEASURED: dict[str, tuple[str, ...]] = {
    "03_measuring_tpot": ("check_slope_band", "check_ab_slopes"),
    "04_batching": ("check_batch_ratios",),
    "05_prefix_caching": ("check_ttft_saved", "check_tpot_after_hit", "check_cascade_slopes"),
    "06_gqa_mqa_mla": ("check_layout_ratios", "check_absorbed_share"),
    "07_window_sinks": ("check_window_share",),
    "08_heavy_hitters": ("check_chat_time",),
    "09_kv_quantization": ("check_codec_slopes",),
    "10_speculative_decoding": ("check_refined_speedup",),
}
# Checks whose lesson times once, without retake: the span starts at the code cell above that holds this text (the
# timing cell whose data the check reads), so that every run measures afresh.
START: dict[str, str] = {
    "check_chat_time": "class TimedModel",  # lesson 08: the three chats, timed turn by turn
    "check_refined_speedup": "timed = max(range(n_prompts)",  # lesson 10: T(n) and the drafters' steps
}
UNSEEN = "did not show"  # what kvlab.course.measured.tell prints where the effect was not seen
TAKES = re.compile(r"measurement (\d+) of at most")


@dataclass
class Tally:
    """One check's runs: failures (the error's last line), runs where the effect went unseen, takes, wall seconds."""

    failures: list[str] = field(default_factory=list)
    unseen: int = 0
    takes: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


def spans(nb: nbformat.NotebookNode, grade_ids: tuple[str, ...]) -> dict[str, range]:
    """Each grade id's cells, from the measurement cell above it (the one that calls retake, or START's) through the
    check cell."""
    where = {c.metadata.get("nbgrader", {}).get("grade_id"): i for i, c in enumerate(nb.cells)}
    out = {}
    for grade_id in grade_ids:
        end, marker = where[grade_id], START.get(grade_id, "retake(")
        start = max(i for i in range(end) if nb.cells[i].cell_type == "code" and marker in nb.cells[i].source)
        out[grade_id] = range(start, end + 1)
    return out


def text(cell: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", ()) if o.get("output_type") == "stream")


def loop(lesson: str, runs: int, minutes: float) -> tuple[dict[str, Tally], list[float]]:
    """Run ``lesson``'s solution to its last measured check, then every check's span ``runs`` times, starting no run
    after ``minutes`` of the loop (Ctrl-C stops it too); the tallies hold the runs done."""
    nb = nbformat.read(REPO / "solutions" / lesson / f"{lesson}.ipynb", as_version=4)
    checks = spans(nb, MEASURED[lesson])
    last = max(r.stop for r in checks.values())
    client = NotebookClient(nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": str(REPO)}})
    tallies = {grade_id: Tally() for grade_id in checks}
    loads = []
    with client.setup_kernel():
        for i in range(last):
            if nb.cells[i].cell_type == "code":
                client.execute_cell(nb.cells[i], i)
        stop = time.monotonic() + 60 * minutes
        for run in range(runs):
            if time.monotonic() > stop:
                print(f"{lesson}: --minutes reached after {run} runs", flush=True)
                break
            try:
                one_run(client, nb, checks, tallies, f"{lesson} run {run + 1}")
            except KeyboardInterrupt:
                print(f"{lesson}: stopped during run {run + 1}; that run is left out where it was not finished")
                break
            loads.append(os.getloadavg()[0])
            print(f"{lesson} run {run + 1}/{runs} done, load {load_average()}", flush=True)
    return tallies, loads


def one_run(
    client: NotebookClient, nb: nbformat.NotebookNode, checks: dict[str, range], tallies: dict[str, Tally], name: str
) -> None:
    """Every check's span once, each tallied."""
    for grade_id, span in checks.items():
        tally, t0 = tallies[grade_id], time.perf_counter()
        try:
            for i in span:
                if nb.cells[i].cell_type == "code":
                    client.execute_cell(nb.cells[i], i)
        except CellExecutionError as e:
            tally.failures.append(str(e).strip().splitlines()[-1][:200])
            print(f"{name} {grade_id}: FAILED {tally.failures[-1]}", flush=True)
            continue
        tally.seconds.append(time.perf_counter() - t0)
        tally.unseen += UNSEEN in text(nb.cells[span.stop - 1])
        found = TAKES.search(text(nb.cells[span.start]))
        tally.takes.append(int(found.group(1)) if found else 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lessons", nargs="*", help=f"lessons (default: {', '.join(MEASURED)})")
    parser.add_argument("--runs", type=int, default=50, help="runs of every measured check (default 50)")
    parser.add_argument("--minutes", type=float, default=600.0, help="start no run after this long, per lesson")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs: {args.runs}; allowed: an integer >= 1")
    lessons = checked_lessons(REPO, args.lessons or list(MEASURED), known=list(MEASURED))
    os.environ["KVLAB_QUICK"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    rows = []
    for lesson in lessons:
        tallies, loads = loop(lesson, args.runs, args.minutes)
        for grade_id, t in tallies.items():
            takes = f"{min(t.takes)}-{max(t.takes)}, mean {statistics.mean(t.takes):.2f}" if t.takes else "-"
            span_s = f"{statistics.median(t.seconds):.1f}" if t.seconds else "-"
            load = f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-"
            done = len(t.failures) + len(t.seconds)
            rows.append((lesson, grade_id, f"{len(t.failures)}/{done}", f"{t.unseen}", takes, span_s, load))
    header = ("lesson", "check", "failures", "not seen", "takes", "span s (median)", "load (1 min)")
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
