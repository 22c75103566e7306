"""Shared fixtures for the default scenario: the testbed inventory's values and secrets."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import tempfile
import threading
import time
import urllib.parse

import httpx2 as httpx  # the HTTP client openai 3.x is built on
import pytest
import yaml

REPO = pathlib.Path(__file__).resolve().parents[3]
GROUP_VARS = REPO / "inventories" / "testbed" / "group_vars" / "teamserve"
CACHE = pathlib.Path(os.environ.get("TESTBED_CACHE", "/var/cache/teamserve-testbed"))
GATEWAY = "https://10.231.0.10:8443"  # the testbed box on the LAN (caddy_tls_mode internal)
# The root certificate of the box's Caddy internal CA, fetched by the caddy role (caddy_root_ca_local_path).
GATEWAY_CA = CACHE / "caddy-root.crt"


def ansible_playbook(playbook: pathlib.Path, extra_vars: dict | None = None, *, timeout: int = 1500,
                     stdout_callback: str | None = None, verbosity: int = 0,
                     args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`playbook` against the scenario's inventory, run as an admin runs it: the project's venv, ansible.cfg
    and roles, the testbed's vault password. `extra_vars` go in a 0600 temporary file, so keys stay out of
    argv. Output without colour, in `stdout_callback`'s format when given, with `verbosity` -v flags and
    `args` (more ansible-playbook options) added; `timeout` in seconds."""
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_ROLES_PATH=str(REPO / "roles"),
               ANSIBLE_VAULT_PASSWORD_FILE=str(CACHE / "vault-pass"), ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0")
    if stdout_callback:
        env["ANSIBLE_STDOUT_CALLBACK"] = stdout_callback
    inventory = pathlib.Path(os.environ["MOLECULE_INVENTORY_FILE"]).parent  # with its host_vars and group_vars
    started = time.monotonic()
    with tempfile.NamedTemporaryFile("w", suffix=".json") as extra:
        json.dump(extra_vars or {}, extra)
        extra.flush()
        run = subprocess.run(
            [str(REPO / ".venv" / "bin" / "ansible-playbook"), "-i", str(inventory), "-e", f"@{extra.name}",
             *(["-" + "v" * verbosity] if verbosity else []), *args, str(playbook)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    keep_playbook_output(playbook, run, time.monotonic() - started)
    return run


def keep_playbook_output(playbook: pathlib.Path, run: subprocess.CompletedProcess, seconds: float) -> None:
    """Keep a test's playbook run (its output with profile_tasks' timings, return code and wall time in
    seconds) under MOLECULE_LOG_DIR/default-playbooks/, numbered in run order, so a passing run's time can
    be read afterwards too. Does nothing when MOLECULE_LOG_DIR is not set."""
    if not os.environ.get("MOLECULE_LOG_DIR"):
        return
    folder = pathlib.Path(os.environ["MOLECULE_LOG_DIR"]) / "default-playbooks"
    folder.mkdir(parents=True, exist_ok=True)
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
    name = f"{len(list(folder.glob('*.log'))) + 1:02d}-{time.strftime('%H%M%S')}-{playbook.stem}.log"
    (folder / name).write_text(f"# {test}\n# {playbook.name}: rc {run.returncode} after {seconds:.0f} s\n"
                               + run.stdout + "\n# stderr\n" + run.stderr)


def json_callback_document(stdout: str) -> dict:
    """The one document the ansible.builtin.json callback prints at the end of a run. Other enabled
    callbacks (ansible.cfg's profile_tasks) may print lines before it."""
    start = 0 if stdout.startswith("{") else stdout.index("\n{") + 1
    document, _ = json.JSONDecoder().raw_decode(stdout[start:])
    return document


def users_play(action: str, name: str, keys_file, users: list) -> None:
    """Run playbooks/users.yml with caddy_users = `users` (fails with the play's output tail)."""
    run = ansible_playbook(REPO / "playbooks" / "users.yml", {
        "caddy_users_action": action, "caddy_users_name": name, "caddy_users_keys_file": str(keys_file),
        "caddy_users": users}, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]


def engine_metrics(host) -> dict[str, float]:
    """vLLM's Prometheus counters on the box's loopback, summed over label sets: name -> value."""
    values: dict[str, float] = {}
    for line in host.check_output("curl -sf http://127.0.0.1:8000/metrics").splitlines():
        if line.startswith("vllm:"):
            name, value = line.split("{")[0].split(" ")[0], line.rsplit(" ", 1)[1]
            values[name] = values.get(name, 0.0) + float(value)
    return values


def prometheus_query(host, expr: str, at: float | None = None) -> list[dict]:
    """Prometheus's instant-query result for `expr` (at Unix time `at`, or now), read on `host`'s loopback
    (a box or the front: each runs its own Prometheus on 127.0.0.1:9090)."""
    params = {"query": expr, **({"time": f"{at}"} if at is not None else {})}
    out = host.check_output("curl -sf %s", "http://127.0.0.1:9090/api/v1/query?" + urllib.parse.urlencode(params))
    body = json.loads(out)
    assert body["status"] == "success", body
    result: list[dict] = body["data"]["result"]
    return result


def engine_container(host) -> dict:
    """The engine container as `docker inspect vllm` describes it on `host` (a testinfra host)."""
    return json.loads(host.check_output("docker inspect vllm"))[0]


def engine_cmd(host) -> list[str]:
    """The engine's argv after the image's entry point (vLLM's flags as deployed)."""
    return engine_container(host)["Config"]["Cmd"]


def engine_identity(host) -> tuple:
    """The engine container's ID, start time, main PID and restart count: one of them changes when anything
    restarts or replaces it."""
    state = engine_container(host)
    return state["Id"], state["State"]["StartedAt"], state["State"]["Pid"], state["RestartCount"]


class GatewayWatcher(threading.Thread):
    """Asks the gateway for /v1/models and /health every 0.5 s while a playbook changes the engine; keeps
    (status, error code, Retry-After) of each, in ``seen`` and ``health``.

    Caddy closes idle keep-alive connections when it reloads its config (the maintenance switch is a
    reload; caddyserver/caddy#2466), so a request written to a pooled socket at that instant gets no
    response at all. Nothing reached the server, and clients retry that case (RFC 9110 section 9.2.2;
    the OpenAI SDK retries connection errors twice by default), so the watcher does too: once, on a
    fresh connection. Such retries are counted in ``reconnects``; a second failure is recorded as seen."""

    def __init__(self, key: str) -> None:
        super().__init__(daemon=True)
        self.key, self.done = key, threading.Event()
        self.seen: list[tuple[int, str | None, str | None]] = []
        self.health: list[tuple[int, str | None]] = []
        self.reconnects = 0

    def _get(self, http: httpx.Client, path: str, headers: dict | None = None) -> httpx.Response:
        try:
            return http.get(GATEWAY + path, headers=headers)
        except httpx.RemoteProtocolError:  # the server closed the pooled socket without a response
            self.reconnects += 1
            return http.get(GATEWAY + path, headers=headers)  # httpx dropped the closed socket: a new one

    def run(self) -> None:
        with httpx.Client(verify=str(GATEWAY_CA), timeout=10) as http:
            while not self.done.is_set():
                try:
                    response = self._get(http, "/v1/models", {"Authorization": f"Bearer {self.key}"})
                    code = response.json().get("error", {}).get("code") if response.status_code != 200 else None
                    self.seen.append((response.status_code, code, response.headers.get("Retry-After")))
                    health = self._get(http, "/health")
                    self.health.append((health.status_code, health.headers.get("Retry-After")))
                except (httpx.HTTPError, ValueError) as exc:
                    self.seen.append((0, type(exc).__name__, None))
                time.sleep(0.5)

    def stop(self) -> list:
        self.done.set()
        self.join(20)
        return self.seen


@pytest.fixture(scope="session")
def testbed_vars() -> dict:
    """The committed testbed group_vars (main.yml), as plain data (no templating)."""
    # The team's users are in group_vars/all (the front gateway has them too).
    return {**yaml.safe_load((GROUP_VARS.parent / "all" / "users.yml").read_text()),
            **yaml.safe_load((GROUP_VARS / "main.yml").read_text())}


def vault_view(path: pathlib.Path) -> dict:
    """A vault file decrypted with the testbed's vault password (ansible-vault view), parsed as YAML."""
    out = subprocess.run(
        [str(REPO / ".venv" / "bin" / "ansible-vault"), "view", "--vault-password-file", str(CACHE / "vault-pass"),
         str(path)], check=True, capture_output=True, text=True,
    ).stdout
    return yaml.safe_load(out)


@pytest.fixture(scope="session")
def vault() -> dict:
    """The testbed's decrypted vault (user keys, engine key)."""
    return vault_view(GROUP_VARS / "vault.yml")


@pytest.fixture(scope="session")
def keys() -> dict:
    """The users' keys as the testbed inventory holds them (caddy_keys.vault.yml, where users.yml writes)."""
    return vault_view(GROUP_VARS / "caddy_keys.vault.yml")["caddy_user_keys"]


@pytest.fixture(scope="session")
def gateway_verify(testbed_vars):
    """What HTTP clients verify the gateway with: GATEWAY_CA, or True for plain HTTP."""
    if testbed_vars.get("caddy_tls_mode", "internal") == "off":
        return True
    assert GATEWAY_CA.read_text().startswith("-----BEGIN CERTIFICATE-----"), f"{GATEWAY_CA} is not a PEM certificate"
    return str(GATEWAY_CA)


@pytest.fixture(scope="session")
def engine_as_converged() -> dict:
    """The engine's argv as converge deployed it ({"cmd": [...]}), kept by the first test module that looks
    at the engine before changing it: the rollbacks in test_vllm_engine.py and test_upgrade.py must put this
    one back."""
    return {}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run test_upgrade.py last: the upgrades change the engine's image digest."""
    items.sort(key=lambda item: item.path.name == "test_upgrade.py")
