"""The sweep's plot: TTFT and TPOT percentiles against concurrency, the targets, the plan and the knee.

Drawn with matplotlib (the only module of the package that needs it; imported when a plot is asked for).
The PNG carries the data it was drawn from, read back off the figure's own lines after drawing, as JSON in
its ``teamserve-sweep`` text chunk, so a reader can check what the picture shows without reading pixels:

    {"<gid>": {"x": [...], "y": [...]}, ...}

with gids ``ttft:p50`` ... ``tpot:p99`` (seconds per concurrency), ``ttft:target`` / ``tpot:target``
(horizontal lines, seconds), ``ttft:plan`` / ``ttft:max-num-seqs`` / ``ttft:knee`` and their ``tpot:`` twins
(vertical lines at that concurrency).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

METADATA_KEY = "teamserve-sweep"
_PERCENTILES = (("p50", ":", "tab:cyan"), ("p95", "-", "tab:orange"), ("p99", "--", "tab:purple"))


def plot(sweep: Mapping[str, Any], path: str) -> dict[str, dict[str, list[float]]]:
    """Write the sweep's PNG to ``path``; return the data behind it (the same JSON the PNG carries).

    ``sweep``: the sweep document (``steps``, ``targets``, ``plan`` with ``concurrent_sequences`` and
    ``max_num_seqs``, ``knee["p95"]``). Raises ValueError when it has no step.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display on a controller
    from matplotlib import pyplot

    steps = sorted(sweep.get("steps") or [], key=lambda s: int(s["concurrency"]))
    if not steps:
        raise ValueError("the sweep has no step to plot")
    concurrency = [int(s["concurrency"]) for s in steps]
    targets, plan = sweep["targets"], sweep["plan"]
    knee = (sweep.get("knee") or {}).get("p95") or {}
    marks = [("plan", int(plan["concurrent_sequences"]), "expected concurrency", "tab:blue"),
             ("max-num-seqs", int(plan["max_num_seqs"]), "--max-num-seqs", "tab:gray")]
    if knee.get("concurrency") is not None:
        label = "knee (p95)" + (", no break up to here" if knee.get("never_broke") else "")
        marks.append(("knee", int(knee["concurrency"]), label, "tab:green"))

    figure, axes = pyplot.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    for axis, metric, title in ((axes[0], "ttft", "time to first token"), (axes[1], "tpot", "time per output token")):
        for percentile, style, colour in _PERCENTILES:
            ys = [(s.get(f"{metric}_seconds") or {}).get(percentile) for s in steps]
            points = [(c, float(y)) for c, y in zip(concurrency, ys, strict=True) if y is not None]
            axis.plot([c for c, _ in points], [y for _, y in points], linestyle=style, marker="o", color=colour,
                      label=percentile, gid=f"{metric}:{percentile}")
        axis.axhline(float(targets[f"{metric}_seconds"]), color="tab:red", linewidth=1.2,
                     label=f"target {float(targets[f'{metric}_seconds']):g} s (p95)", gid=f"{metric}:target")
        for gid, x, label, colour in marks:
            axis.axvline(x, color=colour, linestyle="-." if gid != "knee" else "-", linewidth=1.2, label=f"{label}: {x}",
                         gid=f"{metric}:{gid}")
        axis.set_xscale("log", base=2)
        axis.set_xticks(concurrency, [str(c) for c in concurrency])
        axis.set_xlabel("concurrent requests")
        axis.set_ylabel("seconds")
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize="small")
    figure.suptitle(f"{sweep.get('model', '')} on {sweep.get('host', '')}, vLLM {sweep.get('vllm_version', '')}"
                    f" ({sweep.get('at', '')})", fontsize="medium")

    data: dict[str, dict[str, list[float]]] = {}
    for axis in axes:
        for line in axis.get_lines():
            gid = line.get_gid()
            if gid:
                data[gid] = {"x": [float(v) for v in line.get_xdata()], "y": [float(v) for v in line.get_ydata()]}
    figure.savefig(path, dpi=110, metadata={METADATA_KEY: json.dumps(data, sort_keys=True)})
    pyplot.close(figure)
    return data


def read(path: str) -> dict[str, dict[str, list[float]]]:
    """The data behind a sweep PNG (its ``teamserve-sweep`` text chunk). Raises KeyError when it has none."""
    from PIL import Image

    with Image.open(path) as image:
        text = image.info[METADATA_KEY]
    loaded: dict[str, dict[str, list[float]]] = json.loads(text)
    return loaded
