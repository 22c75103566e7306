"""Unit tests of benchmarks/gateway/bench_gateway.py: its statistics and target parsing (the load itself
is exercised by benchmarks/gateway/run.sh on the testbed, not here)."""
from __future__ import annotations

import importlib.util
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gateway" / "bench_gateway.py"
_spec = importlib.util.spec_from_file_location("bench_gateway", _PATH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def stream(ttft: float | None, tokens: int = 0, first: float = 0.0, last: float = 0.0, status=200) -> dict:
    return {"status": status, "ttft_s": ttft, "tokens": tokens, "first_s": first, "last_s": last}


@pytest.mark.parametrize("pct,expected", [(50, 5), (99, 10), (100, 10), (10, 1), (11, 2)])
def test_nearest_rank(pct, expected):
    assert bench.nearest_rank([float(v) for v in range(10, 0, -1)], pct) == expected


@pytest.mark.parametrize("values,pct", [([], 50), ([1.0], 0), ([1.0], 101)])
def test_nearest_rank_rejects(values, pct):
    with pytest.raises(ValueError):
        bench.nearest_rank(values, pct)


def test_parse_target_with_several_keys_and_a_key_file(tmp_path):
    assert bench.parse_target("caddy=https://localhost:8443/v1,k1,k2") == ("caddy", "https://localhost:8443/v1", ["k1", "k2"])
    keyfile = tmp_path / "keys"
    keyfile.write_text("a1,b2\n")
    assert bench.parse_target(f"x=http://127.0.0.1:8000/v1,@{keyfile}")[2] == ["a1", "b2"]


@pytest.mark.parametrize("spec", ["http://127.0.0.1:8000/v1,k", "x=ftp://h/v1,k", "x=http://h/v1", "=http://h/v1,k"])
def test_parse_target_rejects_and_never_echoes_keys(spec):
    with pytest.raises(ValueError) as err:
        bench.parse_target(spec.replace(",k", ",secretkey"))
    assert "secretkey" not in str(err.value)


def test_summarise_pools_bursts_and_counts_refusals():
    bursts = [
        {"streams": [stream(0.1, 11, 1.0, 2.0), stream(0.3, 21, 1.0, 3.0), stream(None, status=503)], "wall_s": 4.0},
        {"streams": [stream(0.2, 5, 0.0, 1.0), stream(None, status=429), stream(None, 0, status=200)], "wall_s": 5.0},
    ]
    s = bench.summarise(bursts)
    assert (s["total"], s["ok"]) == (6, 3)
    assert s["refused"] == {"503": 1, "429": 1, "200 without content": 1}
    assert s["ttft_p50_ms"] == pytest.approx(200) and s["ttft_p99_ms"] == pytest.approx(300)
    assert s["decode_tps"] == pytest.approx(10)  # per stream: 10, 10, 4 tokens/s -> median 10
    assert s["aggregate_tps"] == pytest.approx((32 / 4 + 5 / 5) / 2)  # 8 and 1 tokens/s -> median 4.5


def test_summarise_with_nothing_answered():
    s = bench.summarise([{"streams": [stream(None, status=503)], "wall_s": 0.1}])
    assert s["ok"] == 0 and s["ttft_p50_ms"] is None and s["decode_tps"] is None


def test_table_shows_added_ttft_against_the_baseline():
    def summary(p50, p99):
        return {"total": 4, "ok": 4, "refused": {}, "ttft_p50_ms": p50, "ttft_p99_ms": p99,
                "decode_tps": 50.0, "aggregate_tps": 180.0}
    refused = dict(summary(None, None), ok=0, refused={"503": 4})
    table = bench.markdown_table({16: {"direct": summary(100, 200), "caddy": summary(103.26, 190), "full": refused}},
                                 "direct")
    rows = table.splitlines()
    assert rows[2].startswith("| 16 | direct | 4/4 | 100.0 | 200 | — | — |")
    assert rows[3].startswith("| 16 | caddy | 4/4 | 103.3 | 190 | +3.3 | -10 |")
    assert rows[4].startswith("| 16 | full | 0/4 (4× 503) | - | - | - | - |")


def test_pacer_waits_between_bursts_to_stay_under_the_budget():
    clock = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock[0] += seconds

    pacer = bench.Pacer(100, clock=lambda: clock[0], sleep=sleep)
    assert pacer.wait_for(64) == 0
    clock[0] = 5.0
    assert pacer.wait_for(30) == 0  # 94 in the window
    clock[0] = 10.0
    waited = pacer.wait_for(16)  # 110 > 100: wait until the first burst leaves the window at t=60
    assert 50 <= waited <= 50.1 and clock[0] >= 60
    assert sum(n for _, n in pacer.sent) == 46  # the 30 sent at t=5 are still in the window
    with pytest.raises(ValueError):
        pacer.wait_for(101)
    assert bench.Pacer(0).wait_for(10_000) == 0  # 0 = no pacing
