#!/usr/bin/env python3
"""Run one ``vllm bench serve`` and sample the engine's ``/metrics`` while it runs.

Runs inside the bench container (the engine's own image, host network), standard library only:

    python3 bench_sampler.py --metrics-url http://127.0.0.1:8000/metrics --interval 0.5 \\
        --keep vllm:kv_cache_usage_perc --keep vllm:num_requests_waiting --output /results/x.samples.json \\
        -- vllm bench serve ...

Writes ``--output`` as JSON: ``before`` and ``after`` (the whole /metrics text just before the command
starts and just after it ends: counters and histograms are read as their difference), ``samples`` (one per
interval while the command runs: ``t`` seconds since the start and ``lines``, the /metrics lines that
start with a ``--keep`` name; or ``error`` when a scrape failed), ``seconds`` and ``exit_code``. Parsing is
left to the controller (the project's shared /metrics parser), so this file only records. Exits with the
command's status; SIGTERM (``docker stop``) is passed on to the command.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any


def scrape(url: str, timeout: float) -> str:
    """GET ``url`` and return its text (the Prometheus exposition format)."""
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - the engine on loopback
        return str(response.read().decode("utf-8", "replace"))


def sample_until(done: Callable[[], bool], wait: Callable[[float], Any], start: float, url: str, interval: float,
                 keep: tuple[str, ...], timeout: float) -> list[dict[str, Any]]:
    """Scrape ``url`` every ``interval`` seconds (``wait(interval)`` between scrapes) until ``done()``; returns
    the samples (``t`` in seconds since ``start``, a ``time.monotonic()`` value)."""
    samples: list[dict[str, Any]] = []
    while not done():
        at = round(time.monotonic() - start, 3)
        try:
            text = scrape(url, timeout)
        except OSError as err:
            samples.append({"t": at, "error": str(err)[:200]})
        else:
            samples.append({"t": at, "lines": "\n".join(line for line in text.splitlines() if line.startswith(keep))})
        wait(interval)
    return samples


def finish(before: str, samples: list[dict[str, Any]], start: float, exit_code: int | None, url: str,
           interval: float, timeout: float) -> dict[str, Any]:
    """The JSON document of one run (see the module docstring), with ``after`` scraped now."""
    seconds = round(time.monotonic() - start, 3)
    try:
        after = scrape(url, timeout)
    except OSError as err:  # the engine went away with the command: the counters are unknown, not zero
        after = ""
        samples.append({"t": seconds, "error": f"after: {err}"[:200]})
    return {"before": before, "after": after, "samples": samples, "seconds": seconds,
            "exit_code": exit_code, "interval_seconds": interval}


def run(command: list[str], url: str, interval: float, keep: tuple[str, ...], timeout: float) -> dict[str, Any]:
    """Run ``command`` and sample ``url`` every ``interval`` seconds until it exits; see the module docstring."""
    before = scrape(url, timeout)
    start = time.monotonic()
    child = subprocess.Popen(command)

    def stop(signum: int, _frame: Any) -> None:
        child.send_signal(signum)

    def wait(seconds: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):  # still running: scrape again
            child.wait(timeout=seconds)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    samples = sample_until(lambda: child.poll() is not None, wait, start, url, interval, keep, timeout)
    return finish(before, samples, start, child.returncode, url, interval, timeout)


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run, write the JSON; returns the command's exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--metrics-url", required=True)
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between scrapes")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds one scrape may take")
    parser.add_argument("--keep", action="append", default=[], help="a metric name to keep from every sample")
    parser.add_argument("--output", required=True, help="the JSON file to write")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    result = run(command, args.metrics_url, args.interval, tuple(args.keep), args.timeout)
    with open(args.output, "w", encoding="utf-8") as handle:
        json.dump(result, handle)
    return int(result["exit_code"])


if __name__ == "__main__":
    sys.exit(main())
