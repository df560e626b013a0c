"""A job that shares its GPU chooses no kernel by timing (shapewise.execution.gpushare), tried with a stand-in
autotuner."""

import pytest
from shapewise.execution import gpushare, gpuslots


class Tuner:
    """What the wrapped methods use of Triton's Autotuner: do_bench (a cached property there) and base_fn."""

    def __init__(self):
        self.timed, self.launched, self.written = [], [], []

        def attention():
            pass

        self.base_fn = attention

    @property
    def do_bench(self):
        def time_it(kernel_call, quantiles):
            kernel_call()
            self.timed.append(len(self.launched))
            return [1.0, 1.0, 1.0]

        return self.__dict__.get("do_bench", time_it)


def triton_check_disk_cache(tuner, tuning_key, configs, bench_fn):
    """As Triton's: no choice on disk, so benchmark, then write the choice."""
    bench_fn()
    tuner.written.append(tuning_key)
    return False


def triton_bench(tuner, *args, config, **meta):
    return tuner.do_bench(lambda: tuner.launched.append(config), quantiles=(0.5, 0.2, 0.8))


def benchmark_of(tuner, configs, bench):
    return lambda: [bench(tuner, (), c, {}, triton_bench, *tuner.slot_and_warm) for c in configs]


class Slot:
    def __init__(self, mode):
        self.mode, self.downgraded = mode, 0

    def downgrade(self):
        self.mode, self.downgraded = gpuslots.SHARED, self.downgraded + 1


def _decide(configs, slot, warm=False, alone_until_chosen=False):
    tuner = Tuner()
    tuner.slot_and_warm = (slot, warm)
    result = gpushare.decide(tuner, ("key",), configs, benchmark_of(tuner, configs, gpushare.bench),
                             triton_check_disk_cache, slot, warm, alone_until_chosen)
    return tuner, result


def test_a_shared_job_compiles_the_candidates_and_runs_again_alone():
    with pytest.raises(gpushare.NeedsExclusiveGPU, match="2 candidates to time"):
        _decide(["a", "b"], Slot(gpuslots.SHARED))
    tuner = Tuner()
    tuner.slot_and_warm = (Slot(gpuslots.SHARED), False)
    try:
        gpushare.decide(tuner, ("key",), ["a", "b"], benchmark_of(tuner, ["a", "b"], gpushare.bench),
                        triton_check_disk_cache, tuner.slot_and_warm[0], False, False)
    except gpushare.NeedsExclusiveGPU:
        pass
    assert tuner.launched == ["a", "b"] and tuner.timed == [] and tuner.written == []
    assert "do_bench" not in tuner.__dict__  # Triton's timer is back


def test_a_warm_up_compiles_every_candidate_and_chooses_none():
    tuner, used_cache = _decide(["a", "b", "c"], Slot(gpuslots.SHARED), warm=True)
    assert used_cache is False
    assert tuner.launched == ["a", "b", "c"] and tuner.timed == [] and tuner.written == []


def test_one_candidate_or_a_gpu_held_alone_is_chosen_as_triton_chooses():
    tuner, _ = _decide(["a"], Slot(gpuslots.SHARED))
    assert tuner.timed == [1] and tuner.written == [("key",)]
    slot = Slot(gpuslots.EXCLUSIVE)
    tuner, _ = _decide(["a", "b"], slot)
    assert tuner.timed == [1, 2] and tuner.written == [("key",)] and slot.downgraded == 0
    tuner, _ = _decide(["a", "b"], None)  # SLURM's GPU: no slot, the job's own GPU
    assert tuner.timed == [1, 2]


def test_a_job_run_again_alone_shares_its_gpu_once_the_choice_is_made():
    slot = Slot(gpuslots.EXCLUSIVE)
    tuner, _ = _decide(["a", "b"], slot, alone_until_chosen=True)
    assert tuner.timed == [1, 2] and tuner.written == [("key",)]
    assert slot.downgraded == 1 and slot.mode == gpuslots.SHARED
    with pytest.raises(gpushare.NeedsExclusiveGPU):  # a second choice, met sharing: again, alone
        _decide(["c", "d"], slot, alone_until_chosen=True)


def test_timing_outside_the_cached_choices_is_caught_too():
    tuner = Tuner()
    with pytest.raises(gpushare.NeedsExclusiveGPU, match="outside"):
        gpushare.bench(tuner, (), "a", {}, triton_bench, Slot(gpuslots.SHARED), False)
    assert tuner.launched == ["a"] and tuner.timed == []
    assert gpushare.bench(tuner, (), "b", {}, triton_bench, Slot(gpuslots.SHARED), True) == [0.0, 0.0, 0.0]
    assert gpushare.bench(tuner, (), "c", {}, triton_bench, Slot(gpuslots.EXCLUSIVE), False) == [1.0, 1.0, 1.0]


def test_the_installed_triton_has_the_methods_it_wraps():
    pytest.importorskip("triton")
    assert gpushare.unavailable() is None
    assert issubclass(gpushare.NeedsExclusiveGPU, BaseException)
    assert not issubclass(gpushare.NeedsExclusiveGPU, Exception)  # a job's `except Exception` does not take it
