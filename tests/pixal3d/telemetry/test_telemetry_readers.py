"""Memory readers: Linux /proc and cgroup parsing, macOS raw structures, CUDA/MPS through fakes."""
import ctypes
import sys

import pytest

from pixal3d.telemetry import linux, macos, readers
from pixal3d.telemetry.device import DeviceReader
from pixal3d.telemetry.units import format_bytes, parse_duration, parse_size

STATUS = """Name:\tpython
VmPeak:\t  300000 kB
VmHWM:\t    2048 kB
VmRSS:\t    1024 kB
Threads:\t1
"""


def test_parse_status_reads_rss_and_peak_in_bytes():
    values = linux.parse_status(STATUS)
    assert values["VmRSS"] == 1024 * 1024
    assert values["VmHWM"] == 2048 * 1024
    assert "Threads" not in values


def test_process_memory_is_unknown_when_status_is_missing(tmp_path):
    assert linux.process_memory(tmp_path / "absent") == (None, None)


def test_reset_peak_reports_failure_instead_of_raising(tmp_path):
    assert linux.reset_peak(tmp_path / "no" / "clear_refs") is False


def test_parse_psi():
    text = ("some avg10=1.50 avg60=0.20 avg300=0.00 total=1234\n"
            "full avg10=0.75 avg60=0.00 avg300=0.00 total=99\n")
    values = linux.parse_psi(text)
    assert values["some_avg10"] == 1.5 and values["full_avg10"] == 0.75 and values["some_total"] == 1234


def test_memory_pressure_is_none_without_psi(tmp_path):
    assert linux.memory_pressure(tmp_path / "pressure") is None


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_reads_usage_limit_and_peak(tmp_path):
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/user.slice/job\n")
    group = tmp_path / "root" / "user.slice" / "job"
    _write(group / "memory.current", "1000\n")
    _write(group / "memory.max", "4096\n")
    _write(group / "memory.peak", "2000\n")
    assert linux.cgroup_memory(tmp_path / "root", proc) == linux.CgroupMemory(2, 1000, 4096, 2000)


def test_cgroup_v2_max_means_unlimited(tmp_path):
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/\n")
    _write(tmp_path / "root" / "memory.current", "10\n")
    _write(tmp_path / "root" / "memory.max", "max\n")
    assert linux.cgroup_memory(tmp_path / "root", proc) == linux.CgroupMemory(2, 10, None, None)


def test_cgroup_v1_falls_back_to_the_mount_root_and_treats_huge_limits_as_none(tmp_path):
    proc = tmp_path / "proc_cgroup"
    proc.write_text("4:memory:/not/mounted/here\n0::/\n")
    v1 = tmp_path / "root" / "memory"
    _write(v1 / "memory.usage_in_bytes", "500\n")
    _write(v1 / "memory.limit_in_bytes", "9223372036854771712\n")
    _write(v1 / "memory.max_usage_in_bytes", "900\n")
    assert linux.cgroup_memory(tmp_path / "root", proc) == linux.CgroupMemory(1, 500, None, 900)


def test_a_limit_set_on_a_parent_cgroup_binds_its_child_v2_and_v1(tmp_path):
    """``systemd-run -p MemoryMax`` on a slice, a container's group: the child's own file says "max" (v1: the
    huge number), its parent's holds the limit; the lowest of the chain is the limit (issue 44 item 8)."""
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/pixal3d.slice/run.scope\n")
    v2 = tmp_path / "v2"
    _write(v2 / "pixal3d.slice" / "run.scope" / "memory.current", "100\n")
    _write(v2 / "pixal3d.slice" / "run.scope" / "memory.max", "max\n")
    _write(v2 / "pixal3d.slice" / "memory.max", "3000\n")
    _write(v2 / "memory.max", "max\n")
    assert linux.cgroup_memory(v2, proc).limit == 3000
    _write(v2 / "pixal3d.slice" / "run.scope" / "memory.max", "5000\n")  # a looser child limit binds nothing
    assert linux.cgroup_memory(v2, proc).limit == 3000
    proc.write_text("4:memory:/outer/inner\n")
    v1 = tmp_path / "v1" / "memory"
    _write(v1 / "outer" / "inner" / "memory.usage_in_bytes", "100\n")
    _write(v1 / "outer" / "inner" / "memory.limit_in_bytes", "9223372036854771712\n")
    _write(v1 / "outer" / "memory.limit_in_bytes", "2000\n")
    assert linux.cgroup_memory(tmp_path / "v1", proc).limit == 2000
    _write(v1 / "outer" / "memory.limit_in_bytes", "9223372036854771712\n")  # control: no limit anywhere
    assert linux.cgroup_memory(tmp_path / "v1", proc).limit is None


def test_cgroup_is_none_without_a_memory_controller(tmp_path):
    assert linux.cgroup_memory(tmp_path, tmp_path / "missing") is None


def test_macos_rusage_v4_buffer_gives_footprint_and_lifetime_max():
    info = macos.RusageInfoV4()
    info.ri_phys_footprint = 308 * 2**20
    info.ri_lifetime_max_phys_footprint = 512 * 2**20
    info.ri_resident_size = 1  # a neighbouring field must not leak into the footprint
    assert macos.footprint_from_raw(bytes(info)) == macos.Footprint(308 * 2**20, 512 * 2**20)


def test_macos_rusage_layout_matches_the_sdk_offsets():
    # <sys/resource.h>: 16-byte uuid then uint64 fields; phys_footprint is the 8th uint64 and
    # v4's lifetime_max_phys_footprint follows v2's 18 and v3's 9 fields plus logical_writes.
    assert macos.RusageInfoV2.ri_phys_footprint.offset == 16 + 7 * 8
    assert ctypes.sizeof(macos.RusageInfoV2) == 16 + 18 * 8
    assert macos.RusageInfoV4.ri_lifetime_max_phys_footprint.offset == 16 + (18 + 9 + 1) * 8
    assert ctypes.sizeof(macos.RusageInfoV4) == 16 + (18 + 9 + 8) * 8


def test_macos_rusage_v2_buffer_has_no_lifetime_max():
    info = macos.RusageInfoV2()
    info.ri_phys_footprint = 42
    assert macos.footprint_from_raw(bytes(info)) == macos.Footprint(42, None)


def test_macos_memorystatus_level_from_raw_bytes():
    assert macos.level_from_raw((37).to_bytes(4, sys.byteorder)) == 37
    assert macos.level_from_raw((250).to_bytes(4, sys.byteorder)) is None
    assert macos.level_from_raw(b"\x01") is None


@pytest.mark.skipif(sys.platform == "darwin", reason="checks the non-macOS fallback")
def test_macos_readers_are_unknown_elsewhere():
    assert macos.footprint() is None
    assert macos.memorystatus_level() is None


class FakeCuda:
    def __init__(self):
        self.allocated, self.peak, self.resets = 100, 900, 0

    def memory_allocated(self, device):
        return self.allocated

    def memory_reserved(self, device):
        return 200

    def mem_get_info(self, device):
        return 1000, 4000

    def max_memory_allocated(self, device):
        return self.peak

    def reset_peak_memory_stats(self, device):
        self.resets += 1
        self.peak = self.allocated


def test_cuda_reader_samples_and_reads_exact_peak_then_resets():
    api = FakeCuda()
    reader = DeviceReader("cuda:0", api=api)
    assert reader.sample() == {"device": 100, "device_reserved": 200, "device_free": 1000,
                               "device_total": 4000}
    assert reader.peak_and_reset() == 900
    assert api.resets == 1
    assert reader.peak_and_reset() == 100


class FakeMps:
    def current_allocated_memory(self):
        return 7

    def driver_allocated_memory(self):
        return 11


def test_mps_reader_samples_and_has_no_exact_peak():
    reader = DeviceReader("mps", api=FakeMps())
    assert reader.sample() == {"device": 7, "device_driver": 11}
    assert reader.peak_and_reset() is None


def test_cpu_device_reads_nothing():
    reader = DeviceReader("cpu")
    assert reader.sample() == {} and reader.peak_and_reset() is None


def test_failing_device_counter_degrades_to_unknown():
    class Broken(FakeCuda):
        def memory_allocated(self, device):
            raise RuntimeError("no CUDA")

    assert DeviceReader("cuda", api=Broken()).sample() == {}


def test_lifetime_high_water_gives_exact_peak_only_when_it_rose(monkeypatch):
    process = readers.ProcessMemory.__new__(readers.ProcessMemory)
    process.platform, process._reset_works, process._last_high = "darwin", False, 100
    highs = iter([100, 250, 250])
    monkeypatch.setattr(process, "_high_water", lambda: next(highs))
    assert process.peak_and_reset() is None  # no new high: only sampling can tell
    assert process.peak_and_reset() == 250  # a new high was reached in this window
    assert process.peak_and_reset() is None


@pytest.mark.skipif(not linux.is_linux(), reason="Linux /proc")
def test_system_readings_on_linux_are_plausible():
    memory = readers.system_memory()
    assert memory.total > 0 and 0 < memory.available <= memory.total
    assert 0 < memory.available_percent <= 100
    sample = readers.MemoryProbe().sample()
    assert sample["process"] > 10 * 2**20


def test_units_parse_strictly():
    assert parse_size("8G") == 8 * 2**30 and parse_size("512M") == 512 * 2**20
    assert parse_size("1.5GiB") == int(1.5 * 2**30) and parse_size("100") == 100
    assert parse_duration("30s") == 30 and parse_duration("5m") == 300
    assert parse_duration("250ms") == 0.25 and parse_duration("2h") == 7200 and parse_duration("5") == 5
    for bad in ("", "G8", "8X", "-1G", "8 G B"):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(bad)
    for bad in ("", "5d", "-1s", "m5"):
        with pytest.raises(ValueError, match="not a duration"):
            parse_duration(bad)
    assert format_bytes(None) == "-" and format_bytes(3 * 2**30) == "3.00 GiB"


def test_macos_available_percent_is_the_memorystatus_level(monkeypatch):
    monkeypatch.setattr(readers.sys, "platform", "darwin")
    monkeypatch.setattr(readers.macos, "memorystatus_level", lambda: 23)
    memory = readers.system_memory()
    assert memory.available_percent == 23.0


def test_cgroup_limit_below_the_machine_bounds_available_memory(monkeypatch):
    monkeypatch.setattr(readers.sys, "platform", "linux")
    virtual = type("VM", (), {"total": 64 * 2**30, "available": 40 * 2**30})()
    monkeypatch.setattr(readers.psutil, "virtual_memory", lambda: virtual)
    monkeypatch.setattr(readers.linux, "cgroup_memory",
                        lambda: linux.CgroupMemory(2, 6 * 2**30, 8 * 2**30, None))
    memory = readers.system_memory()
    assert (memory.total, memory.available) == (8 * 2**30, 2 * 2**30)
    assert memory.available_percent == 25.0


def test_system_memory_degrades_to_unknown(monkeypatch):
    def broken():
        raise OSError("no /proc/meminfo")

    monkeypatch.setattr(readers.sys, "platform", "linux")
    monkeypatch.setattr(readers.psutil, "virtual_memory", broken)
    monkeypatch.setattr(readers.psutil, "swap_memory", broken)
    assert readers.system_memory() == readers.SystemMemory(None, None, None, None)
