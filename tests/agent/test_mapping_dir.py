"""MappingDirMapper on mapping dirs built in tmp_path, and contrib/slurm's prolog/epilog run with bash."""

from __future__ import annotations

import logging
import math
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuledger.agent.mappers import make_mapper
from gpuledger.agent.mappers.base import JobMapper
from gpuledger.agent.mappers.mapping_dir import (
    GpuKey,
    JobEntry,
    MappingDirMapper,
    parse_auto_mapping,
    parse_dcgm_mapping,
    parse_jobstats_mapping,
    parse_mapping_name,
    read_mapping_dir,
)
from gpuledger.schema.records import GpuSample

CONTRIB = Path(__file__).resolve().parents[2] / "contrib" / "slurm"
UUID0 = "GPU-5c5a6c10-0e3c-4f0a-b0e0-5b1f2b2b1c01"


def sample(index: int, mig: str | None = None, uuid: str | None = None) -> GpuSample:
    return GpuSample(ts=0.0, host="vm", gpu_uuid=uuid or f"GPU-0000000{index}-aaaa-bbbb-cccc-dddddddddddd",
                     gpu_index=index, mig=mig)


# -- pure parsers ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, key",
    [
        ("0", GpuKey(index=0)),
        ("7", GpuKey(index=7)),
        ("3.2", GpuKey(index=3, gpu_instance=2)),
        (UUID0, GpuKey(uuid=UUID0)),
        ("MIG-1f2d6f5a-5e2b-5b8a-9d0e-2c8b9d1a7e44", GpuKey(uuid="MIG-1f2d6f5a-5e2b-5b8a-9d0e-2c8b9d1a7e44")),
        (".lock", None),
        (".2.1234.tmp", None),
        ("README", None),
        ("3.2.1", None),
        ("-1", None),
    ],
)
def test_parse_mapping_name(name: str, key: GpuKey | None) -> None:
    assert parse_mapping_name(name) == key


def test_parse_file_bodies() -> None:
    assert parse_dcgm_mapping("16\n17\n\n16\n") == (JobEntry("16"), JobEntry("17"))
    assert parse_dcgm_mapping("12_4\n") == (JobEntry("12_4"),)
    assert parse_jobstats_mapping("16 1002\n17 1003\nbroken\n18 x\n") == (JobEntry("16", 1002), JobEntry("17", 1003))
    assert parse_auto_mapping("16 1002\n17\n16\na b c\n") == (JobEntry("16", 1002), JobEntry("17"))
    assert parse_auto_mapping("17\n17 1003\n") == (JobEntry("17", 1003),)
    assert parse_auto_mapping("") == ()


@given(st.lists(st.tuples(st.from_regex(r"[1-9][0-9]{0,9}(_[0-9]{1,4})?", fullmatch=True), st.integers(0, 2**31)),
                max_size=8))
def test_jobstats_and_auto_agree_on_jobstats_files(lines: list[tuple[str, int]]) -> None:
    text = "".join(f"{j} {u}\n" for j, u in lines)
    assert parse_auto_mapping(text) == parse_jobstats_mapping(text)
    dcgm = parse_dcgm_mapping("".join(f"{j}\n" for j, _ in lines))
    assert [e.job_id for e in dcgm] == [e.job_id for e in parse_auto_mapping(text)]


# -- the mapper -----------------------------------------------------------------------------------


def write(d: Path, name: str, body: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(body)


def test_registered_and_a_jobmapper(tmp_path: Path) -> None:
    m = make_mapper("mapping-dir", path=str(tmp_path))
    assert isinstance(m, MappingDirMapper) and isinstance(m, JobMapper)
    with pytest.raises(ValueError):
        MappingDirMapper(tmp_path, format="slurm")  # type: ignore[arg-type]


def test_dcgm_format_by_index_with_a_shared_gpu(tmp_path: Path) -> None:
    write(tmp_path, "1", "16\n")
    write(tmp_path, "2", "17\n16\n")
    m = MappingDirMapper(tmp_path, format="dcgm")
    out = m.map([sample(0), sample(1), sample(2)])
    assert [s.job_ids for s in out] == [(), ("16",), ("16", "17")]
    assert out[2].job_shares == (0.5, 0.5) and math.fsum(out[2].job_shares) == 1.0
    assert out[1].job_shares == ()
    meta = m.job_metadata()
    assert list(meta) == ["16", "17"]
    assert meta["16"].gpu_uuids == tuple(sorted((out[1].gpu_uuid, out[2].gpu_uuid)))
    assert meta["16"].uid is None


def test_jobstats_format_by_index_and_uuid(tmp_path: Path) -> None:
    write(tmp_path, "0", "20 1001\n")
    write(tmp_path, UUID0, "21 1003\n")
    m = MappingDirMapper(tmp_path, format="jobstats")
    out = m.map([sample(0), sample(5, uuid=UUID0)])
    assert [s.job_ids for s in out] == [("20",), ("21",)]
    assert {j: r.uid for j, r in m.job_metadata().items()} == {"20": 1001, "21": 1003}


def test_format_filters_what_it_reads(tmp_path: Path) -> None:
    write(tmp_path, "0", "20 1001\n")
    write(tmp_path, "1.1", "30\n")
    write(tmp_path, UUID0, "21 1003\n")
    assert set(read_mapping_dir(tmp_path, "dcgm")) == {GpuKey(index=0), GpuKey(index=1, gpu_instance=1)}
    # dcgm-exporter would read "20 1001" as one job id; the strict reader does too.
    assert read_mapping_dir(tmp_path, "dcgm")[GpuKey(index=0)] == (JobEntry("20 1001"),)
    assert set(read_mapping_dir(tmp_path, "jobstats")) == {GpuKey(index=0), GpuKey(uuid=UUID0)}
    assert len(read_mapping_dir(tmp_path, "auto")) == 3


@pytest.mark.parametrize("mig", ["1.0", "1"])
def test_mig_instance_files_match_gpu_instance(tmp_path: Path, mig: str) -> None:
    # dcgm-exporter names MIG files <gpu>.<gpu instance>; sample.mig is "<gi>.<ci>" or "<gi>".
    write(tmp_path, "3.1", "40\n")
    write(tmp_path, "3.2", "41\n")
    m = MappingDirMapper(tmp_path)
    out = m.map([sample(3, mig=mig), sample(3, mig="2.0"), sample(3, mig="5"), sample(4, mig=mig), sample(3)])
    assert [s.job_ids for s in out] == [("40",), ("41",), (), (), ()]


def test_whole_gpu_file_applies_to_its_mig_instances_and_profile_names(tmp_path: Path) -> None:
    write(tmp_path, "3", "50\n")
    write(tmp_path, "3.1", "40\n")
    out = MappingDirMapper(tmp_path).map([sample(3, mig="1.0"), sample(3, mig="2"), sample(3, mig="3g.40gb")])
    assert [s.job_ids for s in out] == [("40", "50"), ("50",), ("50",)]


def test_missing_dir_means_no_jobs_and_logs_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = tmp_path / "absent"
    m = MappingDirMapper(d)
    keep = replace(sample(0), job_ids=("from-source",))
    with caplog.at_level(logging.WARNING, logger="gpuledger.agent.mappers.mapping_dir"):
        assert m.map([sample(0)]) == [sample(0)]
        assert m.map([keep]) == [keep]
    assert len(caplog.records) == 1 and str(d) in caplog.records[0].getMessage()
    write(d, "0", "7\n")
    assert m.map([sample(0)])[0].job_ids == ("7",)
    (d / "0").unlink()
    d.rmdir()
    with caplog.at_level(logging.WARNING, logger="gpuledger.agent.mappers.mapping_dir"):
        m.map([sample(0)])
    assert len(caplog.records) == 2  # logged again: it disappeared after having been there
    assert m.job_metadata() == {}


def test_unreadable_file_is_skipped(tmp_path: Path) -> None:
    write(tmp_path, "0", "7\n")
    (tmp_path / "1").mkdir()  # opening a directory as a file fails with an OSError
    out = MappingDirMapper(tmp_path).map([sample(0), sample(1)])
    assert [s.job_ids for s in out] == [("7",), ()]


# -- contrib/slurm prolog and epilog, run by bash ------------------------------------------------------


def run_script(name: str, tmp_path: Path, job: str, uid: str | None,
               gpus: str | None, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {**extra,
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "GPULEDGER_MAPPING_CONF": str(tmp_path / "no-such.conf"),
        "GPULEDGER_DCGM_DIR": str(tmp_path / "dcgm"),
        "GPULEDGER_JOBSTATS_DIR": str(tmp_path / "jobstats"),
        "SLURM_JOB_ID": job,
    }
    if uid is not None:
        env["SLURM_JOB_UID"] = uid
    if gpus is not None:
        env["SLURM_JOB_GPUS"] = gpus
    return subprocess.run(["bash", str(CONTRIB / name)], env=env, capture_output=True, text=True, timeout=30)


def listing(d: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(d.iterdir()) if not p.name.startswith(".")}


def test_prolog_epilog_write_and_remove_both_formats(tmp_path: Path) -> None:
    # Job 16 on node GPUs 1,2 (the real capture's SLURM_JOB_GPUS); job 17 shares GPU 2.
    assert run_script("prolog.sh", tmp_path, "16", "1002", "1,2").returncode == 0
    assert run_script("prolog.sh", tmp_path, "17", "1003", "2").returncode == 0
    assert run_script("prolog.sh", tmp_path, "17", "1003", "2").returncode == 0  # a rerun adds nothing
    assert listing(tmp_path / "dcgm") == {"1": "16\n", "2": "16\n17\n"}
    assert listing(tmp_path / "jobstats") == {"1": "16 1002\n", "2": "16 1002\n17 1003\n"}
    for fmt in ("dcgm", "jobstats", "auto"):
        d = tmp_path / ("jobstats" if fmt == "jobstats" else "dcgm")
        out = MappingDirMapper(d, format=fmt).map([sample(0), sample(1), sample(2)])  # type: ignore[arg-type]
        assert [s.job_ids for s in out] == [(), ("16",), ("16", "17")]
    # The epilog of job 16 removes only its own lines; the shared GPU keeps job 17.
    assert run_script("epilog.sh", tmp_path, "16", "1002", "1,2").returncode == 0
    assert listing(tmp_path / "dcgm") == {"2": "17\n"}
    assert listing(tmp_path / "jobstats") == {"2": "17 1003\n"}
    # An epilog without SLURM_JOB_GPUS still finds its job's lines.
    assert run_script("epilog.sh", tmp_path, "17", "1003", None).returncode == 0
    assert listing(tmp_path / "dcgm") == {} and listing(tmp_path / "jobstats") == {}


def test_an_array_task_is_written_by_its_array_name_and_removed_by_it(tmp_path: Path) -> None:
    # task 7 of array 1234 is raw job 1236: sacct, the ledger and slurm-cgroup name it 1234_7
    task = {"SLURM_ARRAY_JOB_ID": "1234", "SLURM_ARRAY_TASK_ID": "7"}
    assert run_script("prolog.sh", tmp_path, "1236", "1002", "0", **task).returncode == 0
    assert run_script("prolog.sh", tmp_path, "1240", "1002", "0").returncode == 0
    assert listing(tmp_path / "dcgm") == {"0": "1234_7\n1240\n"}
    assert listing(tmp_path / "jobstats") == {"0": "1234_7 1002\n1240 1002\n"}
    assert [s.job_ids for s in MappingDirMapper(tmp_path / "dcgm").map([sample(0)])] == [("1234_7", "1240")]
    # a raw id line left by an earlier prolog goes too
    (tmp_path / "dcgm" / "1").write_text("1236\n")
    assert run_script("epilog.sh", tmp_path, "1236", "1002", None, **task).returncode == 0
    assert listing(tmp_path / "dcgm") == {"0": "1240\n"} and listing(tmp_path / "jobstats") == {"0": "1240 1002\n"}


def test_epilog_does_not_remove_a_job_whose_id_is_a_prefix(tmp_path: Path) -> None:
    run_script("prolog.sh", tmp_path, "16", "1002", "0")
    run_script("prolog.sh", tmp_path, "160", "1002", "0")
    run_script("epilog.sh", tmp_path, "16", "1002", "0")
    assert listing(tmp_path / "dcgm") == {"0": "160\n"}


def test_scripts_never_fail_the_job(tmp_path: Path) -> None:
    # No GPUs, odd GPU ids, no uid, an uncreatable directory: exit 0 always (non-zero drains the node).
    assert run_script("prolog.sh", tmp_path, "30", "1000", None).returncode == 0
    assert run_script("prolog.sh", tmp_path, "31", None, "GPU-abc,3").returncode == 0
    assert listing(tmp_path / "dcgm") == {"3": "31\n"}
    assert not (tmp_path / "jobstats" / "3").exists()  # no uid: jobstats format skipped
    (tmp_path / "file").write_text("")
    env_dir = tmp_path / "file" / "sub"
    r = subprocess.run(
        ["bash", str(CONTRIB / "prolog.sh")],
        env={"PATH": os.environ["PATH"], "GPULEDGER_MAPPING_CONF": "/nonexistent", "GPULEDGER_DCGM_DIR": str(env_dir),
             "GPULEDGER_JOBSTATS_DIR": "", "SLURM_JOB_ID": "32", "SLURM_JOB_GPUS": "0"},
        capture_output=True, text=True, timeout=30,
    )
    assert r.returncode == 0


def test_settings_from_conf_file(tmp_path: Path) -> None:
    conf = tmp_path / "mapping.conf"
    conf.write_text(f"GPULEDGER_DCGM_DIR={tmp_path}/from-conf\nGPULEDGER_JOBSTATS_DIR=\n")
    r = subprocess.run(
        ["bash", str(CONTRIB / "prolog.sh")],
        env={"PATH": os.environ["PATH"], "GPULEDGER_MAPPING_CONF": str(conf), "SLURM_JOB_ID": "9",
             "SLURM_JOB_UID": "1002", "SLURM_JOB_GPUS": "1,2"},
        capture_output=True, text=True, timeout=30,
    )
    assert r.returncode == 0
    assert listing(tmp_path / "from-conf") == {"1": "9\n", "2": "9\n"}
    assert not (tmp_path / "jobstats").exists()


def test_concurrent_prologs_on_one_gpu_lose_no_job(tmp_path: Path) -> None:
    env_base = {"PATH": os.environ["PATH"], "GPULEDGER_MAPPING_CONF": "/nonexistent",
                "GPULEDGER_DCGM_DIR": str(tmp_path / "dcgm"), "GPULEDGER_JOBSTATS_DIR": str(tmp_path / "jobstats"),
                "SLURM_JOB_UID": "1000", "SLURM_JOB_GPUS": "0"}
    procs = [subprocess.Popen(["bash", str(CONTRIB / "prolog.sh")], env={**env_base, "SLURM_JOB_ID": str(100 + i)})
             for i in range(12)]
    assert all(p.wait(timeout=60) == 0 for p in procs)
    assert sorted(parse_dcgm_mapping((tmp_path / "dcgm" / "0").read_text()),
                  key=lambda e: e.job_id) == [JobEntry(str(100 + i)) for i in range(12)]


def test_a_file_or_table_naming_a_mig_instance_by_its_own_uuid_maps_that_instance(tmp_path: Path) -> None:
    # jobstats names a MIG card's file by the instance's UUID ("MIG-..."): samples carry the GPU's UUID and the
    # instance id, so the mapper needs the source's MIG UUIDs to match it (the agent CLI wires NvmlSource's in)
    from nvml_fake import MIB, FakeGpu, FakeMigInstance, FakeNvml, FakeProcess, Scenario, busy_gpm

    from gpuledger.agent.cli import _stages, _with_mig_uuids
    from gpuledger.agent.mappers.static import StaticMapper
    from gpuledger.agent.sources.nvml import NvmlSource

    gpu = FakeGpu("GPU-1f2d6f5a-0000-4000-8000-000000000000", gpm=busy_gpm(),
                  mig=[FakeMigInstance(1, "3g.40gb"), FakeMigInstance(2, "4g.40gb")],
                  processes=[FakeProcess(11, MIB, gpu_instance=1)])
    lib = FakeNvml(Scenario([gpu]))
    src = NvmlSource(lib=lib, host="n")
    src.open()
    samples = src.sample()
    mig_uuid = lib.nvmlDeviceGetUUID(lib.nvmlDeviceGetMigDeviceHandleByIndex(lib.nvmlDeviceGetHandleByIndex(0), 0))
    assert src.mig_uuids()[(gpu.uuid, "1")] == mig_uuid
    (tmp_path / mig_uuid).write_text("4242 1000\n")
    (mapper, _) = _with_mig_uuids(_stages(["mapping-dir"], str(tmp_path)), src)
    assert [(s.mig, s.job_ids) for s in mapper.map(samples)] == [(None, ()), ("1", ("4242",)), ("2", ())]
    assert mapper.job_metadata()["4242"].uid == 1000
    static = StaticMapper({mig_uuid: "4242"}, mig_uuids=src.mig_uuids)
    assert [(s.mig, s.job_ids) for s in static.map(samples)] == [(None, ()), ("1", ("4242",)), ("2", ())]
    # without the source's UUIDs nothing can match (as before): the instance takes no job from such a file
    assert [s.job_ids for s in make_mapper("mapping-dir", path=tmp_path).map(samples)] == [(), (), ()]
    src.close()
