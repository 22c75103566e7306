"""The dashboard's refusals panel, asked of the real Prometheus of the pinned Debian package
(tests/unit/real_prometheus.py) over samples shaped as mtail exports them: a user refused for the first
time within the hour has a series that starts at its count (carol, 25 refusals in one burst), and a user
refused before has a series that grows (bob, 10 more within the hour). The panel must show both; the
plain increase() it used before read carol's burst as 0."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from collections.abc import Iterator

import pytest
from real_prometheus import serve
from repo_modules import REPO

DASHBOARD = REPO / "roles" / "monitoring" / "files" / "grafana" / "teamserve-dashboard.json"
NOW = 1_764_892_800  # 2025-12-05 00:00 UTC: any fixed instant; the samples lead up to it
STEP = 15  # seconds between scrapes, as the testbed scrapes
METRIC = "teamserve_gateway_refusals_total"


def panel_expr() -> str:
    """The query of the panel "Refusals by user and kind (last hour)"."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    (panel,) = [p for p in panels if p.get("title") == "Refusals by user and kind (last hour)"]
    (target,) = panel["targets"]
    return str(target["expr"])


def series(user: str, kind: str) -> tuple[tuple[str, str], ...]:
    return (("__name__", METRIC), ("job", "mtail"), ("kind", kind), ("user", user))


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    bob = [(t, 0.0 if t < NOW - 1800 else 10.0) for t in range(NOW - 3 * 3600, NOW + 1, STEP)]  # 10 more, 30 min ago
    carol = [(t, 25.0) for t in range(NOW - 1200, NOW + 1, STEP)]  # first refused 20 min ago: born at 25
    samples = {series("bob", "concurrency"): bob, series("carol", "rate_limited"): carol}
    with serve(samples, tmp_path_factory.mktemp("prometheus")) as port:
        yield port


def query(port: int, expr: str) -> dict[tuple[str, str], float]:
    """An instant query at NOW: (user, kind) -> value."""
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr, "time": NOW})
    with urllib.request.urlopen(url, timeout=30) as response:  # noqa: S310 - Prometheus on loopback
        answer = json.load(response)
    assert answer["status"] == "success", answer
    return {(r["metric"]["user"], r["metric"]["kind"]): float(r["value"][1]) for r in answer["data"]["result"]}


def test_the_panel_counts_a_first_burst_whole_and_a_growing_series_by_its_increase(prometheus: int) -> None:
    shown = query(prometheus, panel_expr())
    assert shown[("carol", "rate_limited")] == 25
    assert 10 <= shown[("bob", "concurrency")] < 10.5  # increase() extrapolates to the window's edges
    assert set(shown) == {("carol", "rate_limited"), ("bob", "concurrency")}


def test_plain_increase_misses_the_first_burst(prometheus: int) -> None:
    """Why the panel's query is not just increase(): this is what it showed before."""
    assert query(prometheus, f"sum by (user, kind) (increase({METRIC}[1h]))")[("carol", "rate_limited")] == 0
