"""benchmarks/tree_ab.py: each tree's step runs in a process that imports that tree's kvlab (not the installed one),
the trees take turns, and a bad tree or count is refused by name before anything runs."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import benchmark_module

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "tree_ab.py"
needs_git = pytest.mark.skipif(
    shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs git and a git checkout of kvlab"
)


@pytest.fixture(scope="module")
def tree_ab():
    return benchmark_module("tree_ab")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def rows(stdout: str) -> dict[str, list[str]]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("tree "))
    return {line.split()[0]: line.split() for line in lines[start + 1 :] if not line.startswith("/ first")}


@pytest.fixture(scope="module")
def copied_tree(tmp_path_factory) -> Path:
    """A copy of this checkout's kvlab/ elsewhere: a child that imported the installed (editable) kvlab instead
    would report this checkout's path."""
    root = tmp_path_factory.mktemp("copy")
    shutil.copytree(REPO / "kvlab", root / "kvlab", ignore=shutil.ignore_patterns("__pycache__"))
    return root


@needs_git
@pytest.mark.slow
@pytest.mark.parametrize("mode", [[], ["--keep"]], ids=["fresh", "kept"])
def test_each_tree_runs_its_own_kvlab(copied_tree, mode) -> None:
    result = run("HEAD", str(copied_tree), "--model", "cpu-tiny", "--rounds", "2", "--steps", "3", *mode)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    origin = {
        line.split(":")[0].strip(): line.split("kvlab from ")[1] for line in out.splitlines() if "kvlab from" in line
    }
    assert Path(origin[str(copied_tree)]).is_relative_to(copied_tree), out
    assert "kvlab-tree-ab-" in origin["HEAD"] and not Path(origin["HEAD"]).is_relative_to(REPO), out
    table = rows(out)
    head_commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert head_commit.stdout.startswith(table["HEAD"][1]), out
    assert table["HEAD"][5] == "1.000" and table["HEAD"][6] == "-", out
    wall, ratio, slower = (
        float(table[str(copied_tree)][2]),
        float(table[str(copied_tree)][5]),
        table[str(copied_tree)][6],
    )
    assert wall > 0 and ratio > 0 and slower in {"0/2", "1/2", "2/2"}, out
    assert ("one process per tree" if mode else "a new process per sample") in out
    assert ("a process's own bias shows in both too" in out) == bool(mode)  # the caution --keep needs
    assert "2 rounds: too few to tell a few percent from noise" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["HEAD"], "trees: 1 given; allowed: two or more"),
        (["HEAD", "main", "HEAD"], "trees: HEAD given twice; allowed: distinct names"),
        (["HEAD", "HEAD~0", "--rounds", "0"], "--rounds: 0; allowed: an integer >= 1"),
        (["HEAD", "HEAD~0", "--steps", "1"], "--steps: 1; allowed: an integer >= 2"),
        (["HEAD", "HEAD~0", "--threads", "0"], "--threads: 0; allowed: an integer >= 1"),
        (["HEAD", "HEAD~0", "--model", "no-such-model"], "--model: unknown preset 'no-such-model'; allowed: cpu-tiny"),
        (["HEAD", "HEAD~0", "--model", "mixtral-8x7b"], "--model: mixtral-8x7b cannot run: mixture-of-experts"),
        (["HEAD", "HEAD~0", "--model", "llama-3.1-8b"], "--model: llama-3.1-8b has 8.0B parameters; allowed: cpu-tiny"),
    ],
)
def test_bad_counts_are_refused_by_name(tree_ab, capsys, args, message) -> None:
    with pytest.raises(SystemExit) as exit_info:
        tree_ab.parse(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@needs_git
def test_bad_trees_are_refused_by_name(tree_ab, tmp_path, capsys) -> None:
    parser, _ = tree_ab.parse(["HEAD", "HEAD~0"])
    with pytest.raises(SystemExit):
        tree_ab.prepare("no-such-revision-xyz", tmp_path, parser)
    assert "tree 'no-such-revision-xyz': not a commit" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tree_ab.prepare(str(tmp_path), tmp_path, parser)
    assert f"tree {str(tmp_path)!r}: the directory holds no kvlab/ package" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tree_ab.prepare(str(tmp_path / "gone"), tmp_path, parser)
    assert f"tree {str(tmp_path / 'gone')!r}: no such directory" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(SystemExit):
        tree_ab.prepare(str(tmp_path / "notes.txt"), tmp_path, parser)
    assert "notes.txt': not a directory" in capsys.readouterr().err


def test_a_tree_that_cannot_start_is_named(tmp_path) -> None:
    (tmp_path / "kvlab").mkdir()
    (tmp_path / "kvlab" / "__init__.py").write_text("")  # a kvlab with no Decoder: as a very old revision's
    result = run(str(tmp_path), f"{tmp_path}/.", "--model", "cpu-tiny", "--rounds", "1")  # one tree, two names
    assert result.returncode == 1
    assert f"tree {str(tmp_path)!r} (dir) did not start: its kvlab has no kvlab.Decoder" in result.stderr


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("onnxruntime") is None or importlib.util.find_spec("onnx") is None,
    reason="pip install -e .[onnx]",
)
def test_every_tree_runs_the_runtime_asked_for(copied_tree) -> None:
    """``--runtime`` reaches each tree's Decoder and the report says which runtime it timed; one a tree's Decoder
    refuses is named with that tree's own message."""
    tiny = ("--model", "cpu-tiny", "--rounds", "1", "--steps", "3")
    result = run(str(copied_tree), f"{copied_tree}/.", *tiny, "--runtime", "onnx-packed")
    assert result.returncode == 0, result.stderr
    assert "cpu-tiny, runtime onnx-packed, decode steps" in result.stdout
    result = run(str(copied_tree), f"{copied_tree}/.", *tiny, "--runtime", "fast")
    assert result.returncode == 1
    assert "--runtime fast: this tree's Decoder refused it: runtime: 'fast'; allowed: 'eager'" in result.stderr
