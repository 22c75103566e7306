"""What the monitoring reads from the gateway: the access log's `refused` field on every refusal (with the
user), Caddy's Prometheus metrics on the box's loopback only, and the access log readable by the account
in caddy_access_log_readers (prepare.yml creates it) and by no other.

The refusals are the ones tests/test_fallback.py and tests/test_gateway.py provoked before this module
runs (pytest takes the files in name order); this module reads their entries rather than sending the
traffic again."""
from __future__ import annotations

import socket
import urllib.parse

import pytest
from conftest import access_log_entries

LOG_DIR = "/var/log/caddy"
READER = "logreader"
# Status -> the codes the gateway answers it with (the OpenAI error `code`, also the log's `refused`).
# 499: the client left before the answer (reverse_proxy's own status; no answer, not a refusal).
CODES = {400: {"request_body_incomplete", "too_many_sequences", "invalid_type", "integer_below_min_value",
              "unsupported_encoding"},
         401: {"invalid_api_key"}, 404: {"not_found"}, 408: {"request_timeout"}, 413: {"request_too_large"},
         429: {"rate_limit_exceeded", "concurrency_limit_exceeded", "token_budget_exceeded",
              "tokens_per_minute_exceeded"}, 499: {None},
         502: {"engine_unavailable"}, 503: {"server_full", "maintenance"}, 504: {"engine_timeout"}}


@pytest.fixture(scope="module")
def entries(host) -> list[dict]:
    return access_log_entries(host)


def kinds(entries: list[dict], status: int, user: str | None) -> set:
    """The `refused` values of the entries with this status and user (None: entries without a user)."""
    return {e.get("refused") for e in entries if e["status"] == status and e.get("user") == user}


def test_every_refusal_carries_its_code_and_nothing_else_does(entries):
    assert len(entries) > 100, "run after test_gateway.py, whose traffic this module reads"
    for entry in entries:
        if entry["status"] in CODES:
            assert entry.get("refused") in CODES[entry["status"]], entry
        elif entry["status"] < 400:
            assert "refused" not in entry, entry


def test_the_two_429s_are_told_apart_per_user(entries):
    """alice only ever exceeds her rate (3 a minute, one request at a time); dave only his in-flight cap
    (the flood, the concurrency body test; 1,000 a minute); hana only her daily token budget; ines only her
    per-minute one."""
    assert kinds(entries, 429, "alice") == {"rate_limit_exceeded"}
    assert kinds(entries, 429, "dave") == {"concurrency_limit_exceeded"}
    assert kinds(entries, 429, "hana") == {"token_budget_exceeded"}  # past her daily token budget
    assert kinds(entries, 429, "ines") == {"tokens_per_minute_exceeded"}  # past her per-minute token budget


def test_401_404_413_and_server_full_are_labelled(entries):
    # An unknown or missing key has no user; an expired one does (tests/test_users.py). A path outside the
    # list and a body over the limit are refused before the key is looked at: no user either.
    assert kinds(entries, 401, None) == {"invalid_api_key"}
    assert kinds(entries, 404, None) == {"not_found"}
    assert kinds(entries, 413, None) == {"request_too_large"}
    # dave's request while bob and erin fill the gateway, and the engine's own queue-full 503 for bob.
    assert kinds(entries, 503, "dave") == {"server_full"}
    assert "server_full" in kinds(entries, 503, "bob")


def test_metrics_on_the_loopback_only(host, base_url):
    # One request after the last reload (counters start again with each loaded config).
    host.check_output("curl -s -o /dev/null --cacert /var/lib/caddy/caddy/pki/authorities/local/root.crt "
                      "https://localhost:8443/health")
    metrics = host.check_output("curl -sf http://127.0.0.1:2020/metrics")
    assert any(line.startswith("caddy_http_requests_total{") and 'server="gateway"' in line
               for line in metrics.splitlines()), metrics[:2000]
    for path in ("/", "/config/", "/v1/models", "/metrics/x"):
        assert host.check_output(f"curl -s -o /dev/null -w '%{{http_code}}' http://127.0.0.1:2020{path}") == "404"
    # Not on the box's network address, from the box itself or from the controller.
    address = urllib.parse.urlsplit(base_url).hostname
    assert host.run(f"curl -s -m 5 http://{address}:2020/metrics").rc == 7  # could not connect
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((address, 2020), timeout=5).close()
    # The scrapes are not in the access log.
    assert not [e for e in access_log_entries(host) if e["request"]["host"].endswith(":2020")]


def test_the_reader_account_reads_the_log_and_others_do_not(host):
    """Set before Caddy first started on this box: the ACLs survive systemd's LogsDirectory= handling."""
    log_dir = host.file(LOG_DIR)
    assert (log_dir.user, log_dir.group, log_dir.mode) == ("caddy", "caddy", 0o750)
    assert host.file(f"{LOG_DIR}/access.log").mode == 0o640
    read = f"head -c1 {LOG_DIR}/access.log"
    assert host.run(f"runuser -u {READER} -- {read}").stdout == "{"
    assert host.run(f"runuser -u nobody -- {read}").rc != 0
    assert host.run(f"runuser -u {READER} -- ls {LOG_DIR}").rc != 0  # search only: no listing


def test_a_file_caddy_creates_in_the_log_dir_is_readable_by_the_reader(host):
    """What rolling the log does (the new access.log, the compressed copies): created by caddy with mode
    0640, the file inherits the directory's default ACL."""
    probe = f"{LOG_DIR}/access-acl-probe.log"
    host.check_output(f"runuser -u caddy -- python3 -c \"import os; os.close(os.open('{probe}', "
                      "os.O_CREAT | os.O_WRONLY, 0o640))\"")
    try:
        assert host.file(probe).mode == 0o640
        assert host.run(f"runuser -u {READER} -- head -c0 {probe}").rc == 0
        assert host.run(f"runuser -u nobody -- head -c0 {probe}").rc != 0
    finally:
        host.run(f"rm -f {probe}")
