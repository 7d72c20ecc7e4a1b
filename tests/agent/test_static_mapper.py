"""The static job mapper."""

from __future__ import annotations

import threading

import pytest

from gpuledger.agent.mappers import make_mapper
from gpuledger.agent.mappers.static import StaticMapper
from gpuledger.schema.records import GpuSample


def sample(index: int, uuid: str | None = None, jobs: tuple[str, ...] = (),
           shares: tuple[float, ...] = ()) -> GpuSample:
    return GpuSample(ts=1.0, host="h", gpu_uuid=uuid or f"GPU-{index}", gpu_index=index, job_ids=jobs,
                     job_shares=shares)


def test_maps_by_index_uuid_and_digit_string() -> None:
    m = StaticMapper({0: "100", "GPU-1": ["200", "201"], "2": ("300",)})
    out = m.map([sample(0), sample(1), sample(2), sample(3)])
    assert [s.job_ids for s in out] == [("100",), ("200", "201"), ("300",), ()]


def test_uuid_wins_over_index_and_unmapped_pass_through() -> None:
    m = StaticMapper({0: "by-index", "GPU-x": "by-uuid"})
    prior = sample(5, jobs=("from-earlier-mapper",), shares=(1.0,))
    out = m.map([sample(0, uuid="GPU-x"), prior])
    assert out[0].job_ids == ("by-uuid",)
    assert out[1] is prior


def test_returns_new_samples_and_clears_shares() -> None:
    original = sample(0, jobs=("old-a", "old-b"), shares=(0.25, 0.75))
    out = StaticMapper({0: "new"}).map([original])
    assert out[0] is not original and original.job_ids == ("old-a", "old-b")
    assert out[0].job_ids == ("new",) and out[0].job_shares == ()
    assert out[0].gpu_uuid == original.gpu_uuid


def test_set_and_clear() -> None:
    m = StaticMapper()
    m.set(1, ["7", "8", "7"])
    assert m.map([sample(1)])[0].job_ids == ("7", "8")
    m.set(1, [])
    assert m.map([sample(1)])[0].job_ids == ()
    m.set("GPU-1", "9")
    m.clear("GPU-1")
    m.clear(3)  # clearing an unknown GPU is fine
    assert m.table() == {}


@pytest.mark.parametrize(
    ("gpu", "jobs", "err"),
    [(0, "", ValueError), (0, [""], ValueError), (0, [5], ValueError), (-1, "1", ValueError), ("  ", "1", ValueError),
     (1.5, "1", TypeError), (True, "1", TypeError)],
)
def test_rejects_bad_entries(gpu, jobs, err) -> None:
    with pytest.raises(err, match="static mapper"):
        StaticMapper({gpu: jobs})


def test_registry_builds_it() -> None:
    m = make_mapper("static", mapping={"0": "42"})
    assert m.map([sample(0)])[0].job_ids == ("42",)


def test_concurrent_set_clear_and_map() -> None:
    m = StaticMapper()
    stop = threading.Event()
    failures: list[BaseException] = []
    batch = [sample(i) for i in range(64)]

    def reader() -> None:
        try:
            while not stop.is_set():
                for s in m.map(batch):
                    # Every observed assignment is one that was set whole.
                    assert s.job_ids == () or s.job_ids == (f"{s.gpu_index}", f"{s.gpu_index}b")
        except BaseException as exc:  # noqa: BLE001 - report to the main thread
            failures.append(exc)

    t = threading.Thread(target=reader)
    t.start()
    for _ in range(50):
        for i in range(64):
            m.set(i, [str(i), f"{i}b"])
        for i in range(64):
            m.clear(i)
    stop.set()
    t.join()
    assert not failures
