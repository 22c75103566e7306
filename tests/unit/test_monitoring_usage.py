"""The usage report (roles/monitoring `usage`, playbooks/usage.yml): tokens per user and UTC day from the
gateway's per-user token counter as Prometheus keeps it. The figures must equal the tokens the counter
counted in each day (the ground truth the samples are made from), a restart of the counter included; the
play writes the same rows as CSV, covers every day Prometheus keeps unless told fewer, and refuses a
report longer than that. The samples are held and queried by the real Prometheus of the pinned Debian
package (tests/unit/real_prometheus.py)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import pytest
from real_prometheus import serve
from repo_modules import REPO, load

status = load("monitoring_status", "roles/monitoring/filter_plugins/monitoring_status.py")

DAY = 86_400
START = 1764547200  # 2025-12-01 00:00 UTC
NOW = START + 2 * DAY + 6 * 3600  # 2025-12-03 06:00 UTC: three days, the last one partial


def events() -> list[tuple[int, str, str, int]]:
    """(time, user, kind, tokens) the gateway counted: alice every hour from the start, bob from day 2."""
    out = []
    for hour in range(int((NOW - START) / 3600)):
        t = START + hour * 3600 + 1800
        out.append((t, "alice", "prompt", 100 + hour))
        out.append((t, "alice", "completion", 7))
        if t >= START + DAY + 3600:
            out.append((t, "bob", "prompt", 40))
    return out


RESTART = START + DAY + 12 * 3600 + 900  # mtail restarted on day 2 at 12:15: every counter starts again


def samples() -> dict[tuple[str, str], list[tuple[int, float]]]:
    """The counter's samples as Prometheus holds them, scraped every 5 minutes: each series from its first
    event, back to 0 after RESTART (a series is created again at its next event)."""
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for t in range(START, NOW + 1, 300):
        totals: dict[tuple[str, str], float] = {}
        for at, user, kind, tokens in events():
            if at <= t and (t < RESTART or at >= RESTART):
                totals[(user, kind)] = totals.get((user, kind), 0) + tokens
        for key, value in totals.items():
            series.setdefault(key, []).append((t, value))
    return series


def truth() -> dict[tuple[str, str], dict[str, int]]:
    out: dict[tuple[str, str], dict[str, int]] = {}
    for at, user, kind, tokens in events():
        day = "2025-12-0" + str(1 + (at - START) // DAY)
        row = out.setdefault((day, user), {"prompt_tokens": 0, "completion_tokens": 0})
        row[kind + "_tokens"] += tokens
    return out


SERIES = samples()


# Prometheus was down at the first midnight's scrape: the boundary still reads the day's last value.
MISSED = {START + DAY}


@pytest.fixture
def prometheus(tmp_path_factory) -> Iterator[int]:
    """The pinned Prometheus on 127.0.0.1, holding SERIES as mtail's scrapes would have left them."""
    held = {(("__name__", "teamserve_gateway_tokens_total"), ("job", "mtail"), ("kind", kind), ("user", user)):
            [(t, v) for t, v in points if t not in MISSED] for (user, kind), points in SERIES.items()}
    with serve(held, tmp_path_factory.mktemp("prometheus")) as port:
        yield port


def run_usage(tmp_path: pathlib.Path, port: int, **extra: object) -> subprocess.CompletedProcess:
    """playbooks/usage.yml against a local box reading ``port``'s Prometheus; ``extra`` sets more host vars,
    and a None there leaves the role's default in place."""
    box = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
           "monitoring_prometheus_port": port, "monitoring_usage_time": str(NOW), "monitoring_usage_days": 3,
           "monitoring_usage_csv": str(tmp_path / "usage.csv"), **extra}
    box = {k: v for k, v in box.items() if v is not None}
    (tmp_path / "inventory.yml").write_text(json.dumps({"all": {"children": {"teamserve": {"hosts": {"box": box}}}}}))
    env = {"ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_ROLES_PATH": str(REPO / "roles"),
           "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.json", "ANSIBLE_CALLBACKS_ENABLED": "ansible.builtin.json",
           "PATH": f"{pathlib.Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    return subprocess.run([str(pathlib.Path(sys.executable).parent / "ansible-playbook"), "-i",
                           str(tmp_path / "inventory.yml"), str(REPO / "playbooks" / "usage.yml")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_the_report_counts_each_days_tokens_exactly_a_restart_included(tmp_path, prometheus):
    run = run_usage(tmp_path, prometheus)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    tasks = {t["task"]["name"].split(" : ")[-1]: t["hosts"]["box"] for t in json.loads(run.stdout)["plays"][0]["tasks"]}
    report = tasks["Count the tokens per day and user"]["ansible_facts"]["monitoring_usage"]
    expected = truth()
    assert {(r["day"], r["user"]): {"prompt_tokens": r["prompt_tokens"], "completion_tokens": r["completion_tokens"]}
            for r in report["days"]} == expected
    # Day 2 (the restart) was read from its raw samples, and so was today, whose check reads the last 24 hours
    # (they hold the restart); day 1 from its boundaries.
    assert tasks["Find the days whose counter restarted"]["ansible_facts"]["__monitoring_usage_reset_days"] == [1, 2]
    csv = (tmp_path / "usage.csv").read_text().splitlines()
    assert csv[0] == "day,user,prompt_tokens,completion_tokens" and len(csv) == 1 + len(expected)
    assert f"2025-12-02,bob,{expected[('2025-12-02', 'bob')]['prompt_tokens']},0" in csv
    month = {r["user"]: r for r in report["months"]}
    assert month["alice"]["prompt_tokens"] == sum(v["prompt_tokens"] for (_, u), v in expected.items() if u == "alice")
    assert month["alice"]["days"] == 3 and month["bob"]["days"] == 2
    printed = "\n".join(tasks["Print the monthly totals"]["msg"])
    assert f"2025-12 alice            {month['alice']['prompt_tokens']} prompt + " in printed


def test_a_report_longer_than_prometheus_keeps_is_refused(tmp_path, prometheus):
    run = run_usage(tmp_path, prometheus, monitoring_usage_days=45, monitoring_prometheus_retention="30d")
    assert run.returncode != 0
    assert "monitoring_usage_days=45 must be within [1, 30]" in run.stdout
    assert not (tmp_path / "usage.csv").exists()


@pytest.mark.parametrize(("retention", "days"), [(None, 30), ("7d", 7)], ids=["default-retention", "7d"])
def test_the_readme_command_reports_every_day_prometheus_keeps(tmp_path, prometheus, retention, days):
    """`ansible-playbook … playbooks/usage.yml` as the README prints it (no monitoring_usage_days): the report
    covers the whole days monitoring_prometheus_retention keeps, and counts the same tokens."""
    run = run_usage(tmp_path, prometheus, monitoring_usage_days=None, monitoring_prometheus_retention=retention)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    tasks = {t["task"]["name"].split(" : ")[-1]: t["hosts"]["box"] for t in json.loads(run.stdout)["plays"][0]["tasks"]}
    bounds = tasks["Fix the days the report covers"]["ansible_facts"]["__monitoring_usage_bounds"]
    assert len(bounds) == days + 1 and bounds[0] == NOW // DAY * DAY - (days - 1) * DAY
    report = tasks["Count the tokens per day and user"]["ansible_facts"]["monitoring_usage"]
    assert {(r["day"], r["user"]): {"prompt_tokens": r["prompt_tokens"], "completion_tokens": r["completion_tokens"]}
            for r in report["days"]} == truth()  # the samples span three days, within either report
    assert (tmp_path / "usage.csv").read_text().startswith("day,user,prompt_tokens,completion_tokens\n")


@pytest.mark.parametrize(("text", "days"), [("30d", 30), ("720h", 30), ("1y", 365), ("2w3d", 17), ("36h", 1)])
def test_retention_in_days(text, days):
    assert status.monitoring_duration_days(text) == days


@pytest.mark.parametrize("text", ["", "30", "30 d", "d30", "1.5d"])
def test_retention_that_is_not_a_duration(text):
    with pytest.raises(ValueError, match="not a Prometheus duration"):
        status.monitoring_duration_days(text)


def test_boundaries_end_with_now_and_a_day_whose_end_has_no_sample_counts_nothing():
    bounds = status.monitoring_usage_boundaries(NOW, 2)
    assert bounds == [START + DAY, START + 2 * DAY, NOW]
    values = [{"metric": {"user": "a", "kind": "prompt"}, "values": [[START + DAY, "5"]]}]
    assert status.monitoring_usage_rows(values, bounds) == []
    with pytest.raises(ValueError, match="must be >= 1"):
        status.monitoring_usage_boundaries(NOW, 0)
