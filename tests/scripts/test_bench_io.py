"""Raw-read helpers of the benchmark: byte counts, page-cache residency, eviction."""
import math
import os

import pytest

from scripts import bench_io


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(os.urandom(3 * bench_io.BLOCK // 2 + 12345))  # more than one block, not a multiple
    return path


def test_read_sequential_counts_every_byte_of_every_file(tmp_path, data_file):
    other = tmp_path / "small.bin"
    other.write_bytes(b"x" * 100)
    result = bench_io.read_sequential([data_file, other], "t")
    assert result.nbytes == data_file.stat().st_size + 100
    assert result.seconds > 0 and result.gb_per_s > 0
    assert result.to_dict()["label"] == "t"


def test_a_file_just_read_is_cached_and_eviction_empties_the_cache(data_file):
    bench_io.read_sequential([data_file])
    before = bench_io.cached_fraction(data_file)
    if before is None:
        pytest.skip("mincore is not available here")
    assert before == 1.0
    bench_io.evict(data_file)
    after = bench_io.cached_fraction(data_file)
    if after == before:
        pytest.skip("this filesystem keeps its pages (tmpfs): eviction cannot be observed")
    assert after < 0.05


def test_cold_and_warm_labels_and_mean_cache_state(data_file):
    results = bench_io.cold_and_warm([data_file])
    assert set(results) == {"cold", "warm"}
    warm = results["warm"].cached_before
    assert math.isnan(warm) or warm == 1.0
