"""The weights' read rate on the box (roles/vllm/library/vllm_weights_read.py) and the cold start's
weights-load phase against the floor it gives (roles/vllm/filter_plugins/cold_start.py)."""

from __future__ import annotations

import errno
import json
import os
import pathlib

import pytest
from repo_modules import load

reader = load("vllm_weights_read", "roles/vllm/library/vllm_weights_read.py")
floor = load("vllm_cold_start_filters", "roles/vllm/filter_plugins/cold_start.py")

MIB = 1 << 20


def _write(path: pathlib.Path, size: int) -> pathlib.Path:
    path.write_bytes(os.urandom(size))
    return path


def _direct_allowed(directory: pathlib.Path) -> bool:
    """Whether ``directory``'s filesystem takes O_DIRECT (tmpfs does not)."""
    probe = _write(directory / "probe", 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return False
    finally:
        probe.unlink()
    return True


def _refuse_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def open_without_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args)

    monkeypatch.setattr(reader.os, "open", open_without_direct)


class FakeClock:
    """A clock that advances ``step`` seconds each time it is read."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_reads_the_whole_file_with_o_direct_where_the_filesystem_allows_it(tmp_path):
    # /var/tmp is disk-backed on most hosts where /tmp is tmpfs; the test needs a filesystem that takes O_DIRECT.
    for base in (tmp_path, pathlib.Path("/var/tmp"), pathlib.Path.cwd()):
        if os.access(base, os.W_OK) and _direct_allowed(base):
            break
    else:
        pytest.skip("no writable filesystem here takes O_DIRECT")
    shard = _write(base / f"weights-read-test-{os.getpid()}.safetensors", 3 * MIB + 1000)  # not block-aligned
    try:
        result = reader.read_rate(str(shard), max_bytes=1 << 30, max_seconds=60, block_size=MIB)
    finally:
        shard.unlink()
    assert result["direct"] is True and result["direct_error"] is None
    assert result["read_bytes"] == 3 * MIB + 1000  # the short last block at EOF counts
    assert result["read_bytes_per_second"] > 0


def test_falls_back_to_a_buffered_read_and_says_so(tmp_path, monkeypatch):
    _refuse_direct(monkeypatch)
    shard = _write(tmp_path / "model.safetensors", 2 * MIB)
    result = reader.read_rate(str(shard), max_bytes=1 << 30, max_seconds=60, block_size=MIB)
    assert result["direct"] is False
    assert "errno 22" in result["direct_error"]
    assert result["read_bytes"] == 2 * MIB and result["read_bytes_per_second"] > 0


def test_other_errors_are_not_taken_for_a_refused_o_direct(tmp_path, monkeypatch):
    shard = _write(tmp_path / "model.safetensors", MIB)
    real_open = os.open

    def failing_direct_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EIO, os.strerror(errno.EIO))  # a failing disk: no silent buffered read
        return real_open(path, flags, *args)

    monkeypatch.setattr(reader.os, "open", failing_direct_open)
    with pytest.raises(OSError, match="Input/output error"):
        reader.read_rate(str(shard), max_bytes=MIB, max_seconds=1)


def test_the_read_stops_at_the_byte_bound(tmp_path, monkeypatch):
    _refuse_direct(monkeypatch)  # the bound is the same on both paths; this one runs on any filesystem
    shard = _write(tmp_path / "model.safetensors", 10 * MIB)
    assert reader.read_rate(str(shard), max_bytes=3 * MIB, max_seconds=60, block_size=MIB)["read_bytes"] == 3 * MIB
    # a bound that is not a multiple of 4 KiB is rounded up to one (O_DIRECT reads whole blocks)
    assert reader.read_rate(str(shard), max_bytes=MIB + 1, max_seconds=60, block_size=MIB)["read_bytes"] == MIB + 4096


def test_the_read_stops_at_the_time_bound(tmp_path, monkeypatch):
    _refuse_direct(monkeypatch)
    shard = _write(tmp_path / "model.safetensors", 10 * MIB)
    # The clock moves 1 s per reading: start at 1, block 1 read at 2, block 2 at 3 >= 1 + 2 s: stop.
    result = reader.read_rate(str(shard), max_bytes=1 << 30, max_seconds=2, block_size=MIB, clock=FakeClock(1.0))
    assert result["read_bytes"] == 2 * MIB
    assert result["read_seconds"] == 3.0  # the final reading of the clock
    assert result["read_bytes_per_second"] == int(2 * MIB / 3)


def test_weight_files_are_what_vllm_reads(tmp_path):
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for name, size in [("model-00001-of-00002.safetensors", 300), ("model-00002-of-00002.safetensors", 200),
                       ("consolidated.safetensors", 500), ("pytorch_model.bin", 999), ("config.json", 10)]:
        _write(snapshot / name, size)
    (snapshot / "original").mkdir()
    _write(snapshot / "original" / "consolidated.00.pth", 999)
    (snapshot / reader.INDEX).write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert [pathlib.Path(f).name for f in reader.weight_files(str(snapshot))] == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    # without an index every safetensors file counts; without safetensors, the .bin files but training state
    (snapshot / reader.INDEX).unlink()
    assert len(reader.weight_files(str(snapshot))) == 3
    for f in snapshot.glob("*.safetensors"):
        f.unlink()
    _write(snapshot / "training_args.bin", 10)
    assert [pathlib.Path(f).name for f in reader.weight_files(str(snapshot))] == ["pytorch_model.bin"]
    assert reader.weight_files(str(tmp_path / "absent")) == []


def test_measure_sums_the_files_follows_links_and_reads_the_largest(tmp_path, monkeypatch):
    _refuse_direct(monkeypatch)
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snapshot.mkdir()
    for name, size in [("a.safetensors", MIB), ("b.safetensors", 2 * MIB)]:  # HF cache: links into blobs/
        (snapshot / name).symlink_to(_write(blobs / name, size))
    result = reader.measure(str(snapshot), max_bytes=1 << 30, max_seconds=60, block_size=MIB)
    assert result["changed"] is False
    assert result["bytes"] == 3 * MIB and result["files"] == 2
    assert result["shard"].endswith("b.safetensors") and result["read_bytes"] == 2 * MIB
    assert "buffered, O_DIRECT refused" in result["msg"]


def test_measure_without_weights_reads_nothing(tmp_path):
    result = reader.measure(str(tmp_path), max_bytes=MIB, max_seconds=1, block_size=MIB)
    assert result["bytes"] == 0 and result["shard"] is None and result["read_bytes_per_second"] is None
    assert "no weight files" in result["msg"]


# The H200 box: 16 GB of weights, 1.3 GB/s O_DIRECT; loaded in 11 s (1.46 GB/s, cold) or 2.5 s (page cache).
GB = 10**9


def test_floor_and_ratio_of_a_disk_bound_load():
    result = floor.weights_floor(16 * GB, 1.3 * GB, 11.0)
    assert result["floor_seconds"] == 12.31  # 16e9 bytes / 1.3e9 bytes/s
    assert result["ratio"] == 0.89
    assert result["verdict"] == floor.DISK_BOUND
    assert result["summary"] == ("16.00 GB of weights, load 11.0 s (vLLM's log), disk read 1.30 GB/s (O_DIRECT), "
                                 "floor 12.31 s, ratio 0.89: " + floor.DISK_BOUND)


def test_verdict_at_and_past_the_threshold():
    assert floor.weights_floor(10 * GB, 1 * GB, 15.0)["verdict"] == floor.DISK_BOUND  # ratio 1.5, the threshold
    slow = floor.weights_floor(10 * GB, 1 * GB, 15.1)
    assert slow["ratio"] == 1.51 and slow["verdict"] == floor.SLOWER
    assert floor.weights_floor(10 * GB, 1 * GB, 25.0, threshold=3.0)["verdict"] == floor.DISK_BOUND


def test_a_load_faster_than_the_disk_came_from_page_cache():
    result = floor.weights_floor(16 * GB, 1.3 * GB, 2.5)
    assert result["ratio"] == 0.2 and result["verdict"] == floor.CACHED


def test_a_buffered_read_says_its_rate_may_be_the_page_cache():
    result = floor.weights_floor(16 * GB, 6.5 * GB, 11.0, direct=False)
    assert result["verdict"] == floor.SLOWER + floor.BUFFERED
    assert "6.50 GB/s (buffered)" in result["summary"]


def test_a_small_model_is_given_in_mb_and_its_ratio_uses_the_unrounded_floor():
    # the testbed's tiny model: 6.4 MB at 400 MB/s = 0.016 s; the engine logged 0.01 s
    result = floor.weights_floor(6_400_000, 400_000_000, 0.01)
    assert result["floor_seconds"] == 0.02 and result["ratio"] == 0.62  # 0.01 / 0.016, not 0.01 / 0.02
    assert result["summary"].startswith("6.4 MB of weights, load 0.01 s (vLLM's log), disk read 400.0 MB/s (O_DIRECT)")


@pytest.mark.parametrize(("size", "rate", "load", "missing"), [
    (16 * GB, 1.3 * GB, None, "no \"Loading weights took\" line"),
    (16 * GB, 1.3 * GB, 0, "no \"Loading weights took\" line"),
    (16 * GB, None, 11.0, "gave no rate"),
    (16 * GB, 0, 11.0, "gave no rate"),
    (0, 1.3 * GB, 11.0, "no weight files"),
    (None, None, None, "no weight files"),
    ("not a number", True, "x", "no weight files"),
])
def test_missing_inputs_are_named_not_raised(size, rate, load, missing):
    result = floor.weights_floor(size, rate, load)
    assert missing in result["verdict"]
    assert result["ratio"] is None
    assert "ratio ?" in result["summary"]
    if rate in (None, 0, True):
        assert "disk read ?," in result["summary"]


def test_missing_load_keeps_the_floor():
    result = floor.weights_floor(16 * GB, 1.3 * GB, None)
    assert result["floor_seconds"] == 12.31 and result["load_seconds"] is None


def test_the_filter_reads_the_module_result():
    read = {"bytes": 16 * GB, "read_bytes_per_second": int(1.3 * GB), "direct": True}
    assert floor.vllm_weights_floor(read, 11.0)["ratio"] == 0.89
    # a skipped read task (no bytes, no rate) and an absent one
    assert "no weight files" in floor.vllm_weights_floor({"skipped": True}, 11.0)["verdict"]
    assert "no weight files" in floor.vllm_weights_floor(None)["verdict"]
    # a failed read (the task does not fail the play) is named with its message
    failed = floor.vllm_weights_floor({"failed": True, "msg": "Permission denied"}, 11.0)
    assert failed["verdict"] == "the read of the weights failed (Permission denied): no floor"
    assert failed["floor_seconds"] is None and failed["load_seconds"] == 11.0
    assert floor.FilterModule().filters()["vllm_weights_floor"] is floor.vllm_weights_floor
