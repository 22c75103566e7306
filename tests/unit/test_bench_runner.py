"""The bench container's runner (roles/teamserve_verify/files/bench_runner.py), run for real: a bench module
imported once answers several request files in its spool, each run sampled against a local /metrics
server (test_sweep_filters.py's), with the exit status of a bench that returned, raised or was given
arguments its parser refuses; a malformed request and a module that cannot be imported are answered too,
never left waiting. The bench here is a stand-in module with vLLM's interface (``add_cli_args(parser)``,
``main(args)``); the real one runs in the default molecule scenario's verify.yml and sweep."""

from __future__ import annotations

import json
import os
import pathlib
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from repo_modules import load
from test_sweep_filters import Metrics

runner = load("bench_runner", "roles/teamserve_verify/files/bench_runner.py")

FAKE_BENCH = '''
import pathlib, time
IMPORTED = pathlib.Path(__file__).with_name("imported.log")
with IMPORTED.open("a") as log:  # one line per import
    log.write("imported\\n")


def add_cli_args(parser):
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--fail", action="store_true")


def main(args):
    time.sleep(args.seconds)
    if args.fail:
        raise RuntimeError("the engine answered 500")
    pathlib.Path(args.result).write_text(str(args.seconds))
    return {}
'''


@pytest.fixture()
def metrics() -> Iterator[Metrics]:
    server = Metrics()
    yield server
    server.server.shutdown()


@pytest.fixture()
def spool(tmp_path: pathlib.Path) -> Iterator[pathlib.Path]:
    (tmp_path / "fake_bench.py").write_text(FAKE_BENCH)
    sys.path.insert(0, str(tmp_path))
    directory = tmp_path / "spool"
    directory.mkdir()
    yield directory
    sys.path.remove(str(tmp_path))
    sys.modules.pop("fake_bench", None)


def ask(spool: pathlib.Path, name: str, request: object) -> None:
    """A request file as Ansible's copy writes it: a temporary name, then a rename."""
    temporary = spool / f".{name}.tmp"
    temporary.write_text(json.dumps(request))
    os.replace(temporary, spool / f"{name}.request.json")


def answer(spool: pathlib.Path, name: str, within: float = 20) -> dict:
    deadline = time.monotonic() + within
    while True:
        done = spool / f"{name}.done"
        if done.exists():
            return json.loads(done.read_text())
        if time.monotonic() >= deadline:
            raise AssertionError(f"no answer to {name} within {within} s")
        time.sleep(0.05)


def serving(spool: pathlib.Path, bench, url: str) -> tuple[threading.Thread, list[int]]:
    answered: list[int] = []
    thread = threading.Thread(target=lambda: answered.append(runner.serve(
        spool, bench, url, 0.05, ("vllm:kv_cache_usage_perc",), 1.0, poll=0.02)), daemon=True)
    thread.start()
    return thread, answered


def test_one_import_answers_every_request_in_turn(spool, metrics):
    bench = runner.load_bench("fake_bench")
    thread, answered = serving(spool, bench, metrics.url)
    results = spool.parent / "results"
    results.mkdir()
    ask(spool, "sweep-c1", {"argv": ["--seconds", "0.3", "--result", str(results / "c1")],
                            "output": str(results / "sweep-c1.samples.json")})
    ask(spool, "sweep-c2", {"argv": ["--seconds", "0.2", "--result", str(results / "c2"), "--fail"],
                            "output": str(results / "sweep-c2.samples.json")})
    ask(spool, "sweep-c4", {"argv": ["--seconds", "lots", "--result", str(results / "c4")],
                            "output": str(results / "sweep-c4.samples.json")})
    ask(spool, "sweep-c8", {"argv": "--seconds 1"})  # not a request: no output named
    assert answer(spool, "sweep-c1") == {"exit_code": 0}
    assert answer(spool, "sweep-c2") == {"exit_code": 1}  # the bench raised
    assert answer(spool, "sweep-c4") == {"exit_code": 2}  # its parser refused the arguments
    bad = answer(spool, "sweep-c8")
    assert bad["exit_code"] == 2 and "not a request" in bad["error"]
    (spool / "stop").touch()
    thread.join(10)
    assert not thread.is_alive() and answered == [3]
    assert (spool.parent / "imported.log").read_text() == "imported\n"  # once, for every run
    assert (results / "c1").read_text() == "0.3" and not (results / "c2").exists()
    sampled = json.loads((results / "sweep-c1.samples.json").read_text())
    assert sampled["exit_code"] == 0 and 0.3 <= sampled["seconds"] < 5
    assert len(sampled["samples"]) >= 2 and all(s["lines"].startswith("vllm:kv_cache_usage_perc") for s in sampled["samples"])
    assert "vllm:generation_tokens_total" in sampled["before"] and "vllm:generation_tokens_total" in sampled["after"]
    assert json.loads((results / "sweep-c2.samples.json").read_text())["exit_code"] == 1
    assert sorted(p.name for p in spool.iterdir()) == ["stop", "sweep-c1.done", "sweep-c2.done", "sweep-c4.done",
                                                       "sweep-c8.done"]


def test_a_bench_that_cannot_be_imported_answers_each_request_with_the_reason(spool, metrics, capsys):
    """The command line, as the container runs it: the request waiting and the stop file already there, it
    answers the request and then ends."""
    ask(spool, "bench-c8", {"argv": [], "output": str(spool.parent / "bench-c8.samples.json")})
    (spool / "stop").touch()
    assert runner.main(["--spool", str(spool), "--metrics-url", metrics.url, "--interval", "0.05",
                        "--bench", "no_such_bench"]) == 0
    assert answer(spool, "bench-c8", within=0) == {"exit_code": 1}
    assert json.loads((spool.parent / "bench-c8.samples.json").read_text())["exit_code"] == 1
    assert "no_such_bench could not be imported: ModuleNotFoundError" in capsys.readouterr().err


def test_an_engine_whose_metrics_do_not_answer_gets_the_request_answered(spool):
    """No /metrics on the port: the run is not started, the request is answered 1 with the reason."""
    bench = runner.load_bench("fake_bench")
    ask(spool, "bench-c1", {"argv": ["--seconds", "0", "--result", str(spool.parent / "r")],
                            "output": str(spool.parent / "bench-c1.samples.json")})
    (spool / "stop").touch()
    assert runner.serve(spool, bench, "http://127.0.0.1:9/metrics", 0.05, (), 1.0, poll=0.02) == 0
    done = answer(spool, "bench-c1", within=0)
    assert done["exit_code"] == 1 and "did not answer" in done["error"]
    assert not (spool.parent / "r").exists() and not (spool / "bench-c1.running").exists()
