"""Results kept on disk for a grader: found again only under the same key and code, never half-read."""

from __future__ import annotations

import dataclasses

import pytest

from kvlab.course import disk_memo, incident
from kvlab.course.disk_memo import CACHE_ENV, remembered
from kvlab.course.incident import INCIDENT, Fix


class Counter:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> dict[str, list[int]]:
        self.calls += 1
        return {"value": [self.calls]}


def test_without_the_folder_nothing_is_kept(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    compute = Counter()
    assert remembered("kind", 1, compute) == {"value": [1]}
    assert remembered("kind", 1, compute) == {"value": [2]}
    assert list(tmp_path.iterdir()) == []


def test_the_same_key_under_the_same_code_is_read_back(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "memo"))
    compute = Counter()
    first = remembered("kind", ("a", 1), compute)
    assert remembered("kind", ("a", 1), compute) == first and compute.calls == 1
    assert remembered("kind", ("a", 2), compute) == {"value": [2]}  # another key
    assert remembered("other", ("a", 1), compute) == {"value": [3]}  # another kind
    monkeypatch.setattr(disk_memo, "code_version", lambda: "edited")  # another version of kvlab
    assert remembered("kind", ("a", 1), compute) == {"value": [4]}
    assert not [p for p in (tmp_path / "memo").iterdir() if p.name.startswith(".")]  # no temporary file left


def test_a_torn_file_is_computed_again_and_replaced(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    compute = Counter()
    remembered("kind", 7, compute)
    (entry,) = tmp_path.iterdir()
    entry.write_bytes(entry.read_bytes()[:5])
    assert remembered("kind", 7, compute) == {"value": [2]}
    assert remembered("kind", 7, compute) == {"value": [2]}


def test_code_version_hashes_the_package_sources():
    assert disk_memo.code_version() == disk_memo.code_version()
    assert len(disk_memo.code_version()) == 64


@pytest.mark.parametrize("kind", ["at-scale", "quality"])
def test_an_incident_replay_read_back_is_the_replay(monkeypatch, tmp_path, kind):
    """A second kernel (its in-process memo cleared) reads what the first stored, equal in every result."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    small = dataclasses.replace(INCIDENT, shape=dataclasses.replace(INCIDENT.shape, sessions=2, turns=2))
    fix = Fix(kv_dtype="int8")
    if kind == "at-scale":
        run = lambda: small.at_scale(fix, 0)  # noqa: E731
        memo = incident._at_scale
    else:
        from kvlab.model.pretrained import load_pretrained

        tiny = load_pretrained(small.checkpoint, device="cpu")
        run = lambda: small.quality(fix, 0, tiny)  # noqa: E731
        memo = incident._quality
    memo.cache_clear()
    stored = run()
    memo.cache_clear()
    read = run()
    assert read is not stored
    assert [p.name.split("-")[0] for p in tmp_path.iterdir()] == [kind.split("-")[0]]
    replays = [x if kind == "at-scale" else x.replay for x in (stored, read)]
    results = [[(r.output_ids, r.ttft_ms, r.tpot_ms) for r in x.report.results] for x in replays]
    assert results[0] == results[1]
    if kind == "quality":
        assert (read.recall, read.ppl, read.full_ppl) == (stored.recall, stored.ppl, stored.full_ppl)


def test_a_folder_it_cannot_write_costs_the_saving_not_the_result(monkeypatch, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv(CACHE_ENV, str(blocked / "memo"))
    compute = Counter()
    assert remembered("kind", 1, compute) == {"value": [1]}
    assert remembered("kind", 1, compute) == {"value": [2]}
