"""The real Prometheus of the pinned Debian package (unpacked by tests/tools/monitoring-tools.sh into
$MONITORING_TOOLS), serving given samples on 127.0.0.1, for the monitoring role's read-only entry points
(status, usage): the samples are written as OpenMetrics, turned into TSDB blocks by `promtool tsdb
create-blocks-from openmetrics`, and Prometheus answers PromQL over them as it would on a box."""

from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence

from repo_modules import REPO

TOOLS = pathlib.Path(os.environ.get("MONITORING_TOOLS", REPO / ".cache" / "monitoring-tools")) / "bin"

# Labels (name included, as "__name__") -> (Unix seconds, value) samples, oldest first.
Samples = Mapping[tuple[tuple[str, str], ...], Sequence[tuple[int, float]]]


def openmetrics(samples: Samples) -> str:
    """The samples as an OpenMetrics exposition with timestamps (seconds), in time order, ``# EOF`` last."""
    lines = []
    for labels, points in samples.items():
        named = dict(labels)
        name = named.pop("__name__")
        selector = ",".join(f'{k}="{v}"' for k, v in sorted(named.items()))
        lines += [(t, f"{name}{{{selector}}} {v:g} {t}") for t, v in points]
    return "".join(line + "\n" for _, line in sorted(lines, key=lambda x: x[0])) + "# EOF\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve(samples: Samples, workdir: pathlib.Path) -> Iterator[int]:
    """Run Prometheus over ``samples`` (a TSDB under ``workdir``, kept however old: retention 100 years)
    until the block ends; yields its port on 127.0.0.1. Raises RuntimeError when the blocks cannot be made
    or Prometheus is not ready within 30 s (its log in the message)."""
    prometheus, promtool = TOOLS / "prometheus", TOOLS / "promtool"
    if not prometheus.exists():
        raise RuntimeError(f"{prometheus} is missing: run `make unit` (it unpacks the pinned Debian packages there)")
    data, source = workdir / "tsdb", workdir / "samples.om"
    source.write_text(openmetrics(samples))
    made = subprocess.run([str(promtool), "tsdb", "create-blocks-from", "openmetrics", str(source), str(data)],
                          capture_output=True, text=True, timeout=120, check=False)
    if made.returncode != 0:
        raise RuntimeError(f"promtool could not make blocks: {made.stdout}{made.stderr}")
    config = workdir / "prometheus.yml"
    config.write_text("global: {}\nscrape_configs: []\n")
    port = _free_port()
    log = (workdir / "prometheus.log").open("w")
    process = subprocess.Popen(
        [str(prometheus), f"--config.file={config}", f"--storage.tsdb.path={data}",
         "--storage.tsdb.retention.time=100y", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as ready:
                    if ready.status == 200:
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("Prometheus did not start: " + (workdir / "prometheus.log").read_text()[-3000:])
            time.sleep(0.2)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()
