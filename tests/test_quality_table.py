"""benchmarks/quality_table.py: every policy row builds a working cache, and a small table runs end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvlab.model.pretrained import load_pretrained

from .helpers import benchmark_module


@pytest.fixture(scope="module")
def table():
    return benchmark_module("quality_table")


def test_policies_cover_the_issue_rows(table) -> None:
    names = set(table.POLICIES)
    for w in table.WINDOWS:
        assert {f"window-{w}", f"window-{w}+4sinks/original", f"window-{w}+4sinks/reassigned"} <= names
    assert {f"h2o-{b}" for b in table.H2O_BUDGETS} <= names
    assert {"full", "fp8", "int8", "int4", "fp8/residual-0", "int8/residual-0", "int4/residual-0"} <= names


@pytest.mark.slow
def test_every_policy_reads_no_more_than_the_full_cache(table) -> None:
    model = load_pretrained("kvlab-tiny-stdlib", device="cpu")
    tokens = torch.randint(0, 256, (2, 300))
    caches = {}
    for name, make_cache in table.POLICIES.items():
        caches[name] = cache = make_cache(model, 2, 301)
        model.prefill(tokens, cache)
        model.decode_step(tokens[:, -1], cache)
    read = {name: cache.bytes_read_per_step() for name, cache in caches.items()}
    assert all(read[name] < read["full"] for name in read if name != "full"), read
    # A budget of B tokens reads B tokens' K and V (H2O also its scores): 2 sequences x 4 layers x 2 KV heads x
    # 64 dims x 2 (K and V) x 4 bytes = 8,192 bytes per token.
    per_token = 2 * 4 * 2 * 64 * 2 * 4
    assert read["full"] == 301 * per_token
    assert read["window-64"] == 64 * per_token and read["window-64+4sinks/original"] == 68 * per_token
    assert read["h2o-128"] == 128 * per_token + caches["h2o-128"].score_bytes_read_per_step()
    assert caches["int4"].residual == 128 and caches["int4/residual-0"].residual == 0
    assert read["int4/residual-0"] < read["int4"] < read["int8"]


@pytest.mark.slow
def test_small_table_runs_and_writes_json(table, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "rows.json"
    argv = ["--policies", "full", "window-64", "--contexts", "128", "--tokens", "384", "--trials", "2"]
    table.main([*argv, "--depths", "0", "1", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [r["policy"] for r in rows] == ["full", "window-64"] and all(r["scored_tokens"] == 3 * 127 for r in rows)
    printed = capsys.readouterr().out
    assert "window-64" in printed and "chance" in printed
    with pytest.raises(SystemExit):
        table.main(["--policies", "no-such-policy"])
