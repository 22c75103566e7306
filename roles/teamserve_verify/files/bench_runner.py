#!/usr/bin/env python3
"""Run ``vllm bench serve`` once per request file, all in one process, sampling the engine's ``/metrics``.

Runs inside the bench container (the engine's own image, host network) for the whole of one sweep, load
test or upgrade gate. ``vllm bench serve`` as a command imports vLLM's whole CLI (the engine included)
before it sends a request: 11-15 s on the test machines' two cores, paid by every step when each step is
a container of its own. Here the bench module is imported once and each step is a call to it.

    python3 bench_runner.py --spool /results/spool --metrics-url http://127.0.0.1:8000/metrics \\
        --interval 0.5 --keep vllm:kv_cache_usage_perc --keep vllm:num_requests_waiting

For each ``NAME.request.json`` that appears in ``--spool`` (oldest name first), a JSON object with ``argv``
(the arguments of ``vllm bench serve``, parsed by the bench's own parser) and ``output`` (where the
samples go): renames it ``NAME.running``, runs the bench while a thread samples ``--metrics-url`` every
``--interval`` seconds, writes ``output`` (the document ``bench_sampler.py`` writes: ``before``, ``after``,
``samples``, ``seconds``, ``exit_code``) and last ``NAME.done``, ``{"exit_code": N}``: 0 when the bench
returned, 2 when ``argv`` did not parse, 1 when it raised (the traceback goes to stderr, the container's
log; a bench module that cannot be imported fails every request so). Written through a temporary name and
renamed, so a reader never sees half a file. A file ``stop`` in the spool ends the loop once no request
waits; SIGTERM (``docker stop``) ends it after the run under way. Standard library and the bench module
only (``--bench``, vLLM's ``vllm.benchmarks.serve`` by default: ``add_cli_args(parser)`` and
``main(args)``, vLLM 0.32.0).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_sampler  # noqa: E402 - beside this file in the container's tools directory


def load_bench(module_name: str) -> Callable[[list[str]], None]:
    """Import the bench module once; returns a function that parses ``argv`` with the module's own
    arguments and runs it. Raises ImportError when the module is missing."""
    module = importlib.import_module(module_name)
    parser_class = getattr(module, "FlexibleArgumentParser", argparse.ArgumentParser)

    def bench(argv: list[str]) -> None:
        parser = parser_class(prog="vllm bench serve")
        module.add_cli_args(parser)
        module.main(parser.parse_args(argv))

    return bench


def run_one(bench: Callable[[list[str]], None], argv: list[str], url: str, interval: float,
            keep: tuple[str, ...], timeout: float) -> dict[str, Any]:
    """One bench run with ``url`` sampled meanwhile; returns bench_sampler's document. The bench runs in
    this (the main) thread, the sampling in another."""
    before = bench_sampler.scrape(url, timeout)
    start = time.monotonic()
    finished = threading.Event()
    samples: list[dict[str, Any]] = []
    sampler = threading.Thread(target=lambda: samples.extend(bench_sampler.sample_until(
        finished.is_set, finished.wait, start, url, interval, keep, timeout)), daemon=True)
    sampler.start()
    try:
        bench(argv)
        code = 0
    except SystemExit as err:  # argparse's refusal, or the bench's own exit
        code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
    except Exception:  # noqa: BLE001 - any failure of the bench is reported as its exit status
        traceback.print_exc()
        code = 1
    finally:
        finished.set()
        sampler.join()
    return bench_sampler.finish(before, samples, start, code, url, interval, timeout)


def write_atomically(path: pathlib.Path, document: dict[str, Any]) -> None:
    """``document`` as JSON at ``path``, through a temporary name in the same directory."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(document), encoding="utf-8")
    os.replace(temporary, path)


def pending(spool: pathlib.Path) -> list[pathlib.Path]:
    """The request files waiting in ``spool``, by name (hidden files are others' temporary files)."""
    return sorted(p for p in spool.glob("*.request.json") if not p.name.startswith("."))


def serve(spool: pathlib.Path, bench: Callable[[list[str]], None], url: str, interval: float,
          keep: tuple[str, ...], timeout: float, poll: float = 0.2, stopping: threading.Event | None = None) -> int:
    """Answer request files until none waits and ``spool/stop`` exists, or until ``stopping`` is set;
    returns the number answered."""
    answered = 0
    while not (stopping and stopping.is_set()):
        requests = pending(spool)
        if not requests:
            if (spool / "stop").exists():
                break
            time.sleep(poll)
            continue
        request = requests[0]
        name = request.name.removesuffix(".request.json")
        running = request.with_name(f"{name}.running")
        os.replace(request, running)
        try:
            asked = json.loads(running.read_text(encoding="utf-8"))
            argv, output = [str(a) for a in asked["argv"]], pathlib.Path(asked["output"])
        except (ValueError, KeyError, TypeError) as err:
            print(f"bench runner: {request.name} is not a request ({err})", file=sys.stderr, flush=True)
            write_atomically(spool / f"{name}.done", {"exit_code": 2, "error": f"not a request: {err}"})
            running.unlink()
            continue
        print(f"bench runner: {name}: vllm bench serve {' '.join(argv)}", flush=True)
        try:
            document = run_one(bench, argv, url, interval, keep, timeout)
        except OSError as err:  # the engine's /metrics did not answer before the run: nothing was measured
            print(f"bench runner: {name}: {url} did not answer: {err}", file=sys.stderr, flush=True)
            write_atomically(spool / f"{name}.done", {"exit_code": 1, "error": f"{url} did not answer: {err}"[:300]})
            running.unlink()
            continue
        write_atomically(output, document)
        write_atomically(spool / f"{name}.done", {"exit_code": document["exit_code"]})
        running.unlink()
        answered += 1
    return answered


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, import the bench, answer requests until stopped; returns 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--spool", required=True, type=pathlib.Path, help="the directory of request files")
    parser.add_argument("--metrics-url", required=True)
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between scrapes")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds one scrape may take")
    parser.add_argument("--keep", action="append", default=[], help="a metric name to keep from every sample")
    parser.add_argument("--bench", default="vllm.benchmarks.serve", help="the bench module")
    args = parser.parse_args(argv)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda _signum, _frame: stopping.set())
    try:
        bench = load_bench(args.bench)
    except Exception as err:  # noqa: BLE001 - every request is then answered with the reason, not left waiting
        traceback.print_exc()
        reason = f"{args.bench} could not be imported: {type(err).__name__}: {err}"

        def bench(_argv: list[str]) -> None:
            raise RuntimeError(reason)
    print(f"bench runner: waiting for requests in {args.spool}", flush=True)
    serve(args.spool, bench, args.metrics_url, args.interval, tuple(args.keep), args.timeout, stopping=stopping)
    return 0


if __name__ == "__main__":
    sys.exit(main())
