"""A candidate cannot move the reference it is judged against: the reference runs in the job process, which never
imports the candidate, on inputs drawn there from their seed, and the comparison reads the candidate's output as
plain bytes. Each hostile candidate below passed before (the reference ran in the candidate's own process, after
its import, on the very tensors it was handed)."""

import json
import os
import textwrap

import pytest
import torch

from shapewise.inputs.manifest import normalize_row
from shapewise.jobs.candidate import CandidateFailed, check_output, host_copy, read_plain, write_plain
from test_candidates import run_job

ROW = normalize_row({"id": "hostile-row", "batch_size": 2, "seq_len": 7, "d_model": 32, "num_heads": 2,
                     "ffn_dim": 64, "num_layers": 1, "trials": 2})

# The reference computed in a process the candidate changed: before, the reference computed the same, and passed.
ZEROS = "lambda *args, **kwargs: torch.zeros_like(args[0])"
PATCHES = {
    "layer-norm": f"torch.nn.functional.layer_norm = {ZEROS}",
    "softmax": f"torch.softmax = {ZEROS}",
    "masked-fill": f"torch.Tensor.masked_fill = {ZEROS}",
}


def candidate(tmp_path, name, body):
    path = tmp_path / f"{name.replace('-', '_')}.py"
    path.write_text(textwrap.dedent(body))
    return path


@pytest.mark.parametrize("what", sorted(PATCHES))
def test_a_candidate_that_patches_torch_at_import_fails_against_the_true_reference(tmp_path, what):
    path = candidate(tmp_path, what, f"""
        import torch
        from shapewise.model import BaselineTransformer

        {PATCHES[what]}


        class UserOptimizedTransformer(BaselineTransformer):
            pass
        """)
    acc = run_job(tmp_path, "accuracy", path, row=ROW)
    assert acc["status"] == "fail" and acc["failure"]["kind"] == "accuracy", acc
    assert acc["aggregate"]["official"]["max_abs_error"] > 0.1


def test_a_candidate_that_widens_shapewises_tolerances_returning_zeros_fails(tmp_path):
    path = candidate(tmp_path, "tolerances", """
        import torch
        from shapewise import model
        from shapewise.model import BaselineTransformer
        from shapewise.model import tolerance

        for preset in list(model.TOLERANCES.values()) + list(tolerance.TOLERANCES.values()):
            preset.update(rtol=1e30, atol=1e30)


        class UserOptimizedTransformer(BaselineTransformer):
            def forward(self, x, valid_token_mask=None):
                return torch.zeros_like(x)
        """)
    acc = run_job(tmp_path, "accuracy", path, row=ROW)
    assert acc["status"] == "fail" and acc["failure"]["kind"] == "accuracy", acc
    assert acc["aggregate"]["official"]["failed_elements"] > 0


@pytest.mark.parametrize("when, status", [("before", "fail"), ("after", "pass")])
def test_an_input_zeroed_through_data_is_judged_on_the_seeded_inputs(tmp_path, when, status):
    """x.data.zero_() moves no version counter: the reference must not see the zeroed x. Zeroed before the
    candidate computes, its output is wrong; zeroed after, it is right."""
    path = candidate(tmp_path, f"zeroes-{when}", f"""
        from shapewise.model import BaselineTransformer


        class UserOptimizedTransformer(BaselineTransformer):
            def forward(self, x, valid_token_mask=None):
                if {when == "before"}:
                    x.data.zero_()
                out = super().forward(x, valid_token_mask)
                x.data.zero_()
                return out
        """)
    acc = run_job(tmp_path, "accuracy", path, row=ROW)
    assert acc["status"] == status, acc
    if status == "pass":
        assert acc["aggregate"]["official"]["max_abs_error"] == 0.0


SUBCLASS = """
    import torch
    from shapewise.model import BaselineTransformer


    class Agreeable(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            out = super().__torch_function__(func, types, args, kwargs or {})
            if func is torch.Tensor.__sub__ or func is torch.sub:
                return torch.zeros_like(torch.Tensor(out))
            return out


    class UserOptimizedTransformer(BaselineTransformer):
        def forward(self, x, valid_token_mask=None):
            return torch.zeros_like(x).as_subclass(Agreeable)
    """


def test_a_tensor_subclass_output_is_refused_by_name(tmp_path):
    acc = run_job(tmp_path, "accuracy", candidate(tmp_path, "subclass", SUBCLASS), row=ROW)
    failure = acc["failure"]
    assert acc["status"] == "fail" and (failure["kind"], failure["stage"]) == ("wrong-output", "forward (trial 0)")
    assert "Agreeable, a torch.Tensor subclass" in failure["message"], failure


def test_a_patch_of_torch_in_the_candidates_process_does_not_slow_the_references_rounds(tmp_path):
    """The reference's timing rounds run in the job process: a candidate that makes torch's layer_norm sleep in its
    own process (and never calls it) leaves the reference's time alone."""
    path = candidate(tmp_path, "slows", """
        import time
        import torch
        from shapewise.model import BaselineTransformer

        original = torch.nn.functional.layer_norm


        def layer_norm(*args, **kwargs):
            time.sleep(0.5)
            return original(*args, **kwargs)


        torch.nn.functional.layer_norm = layer_norm


        class UserOptimizedTransformer(BaselineTransformer):
            def forward(self, x, valid_token_mask=None):
                return torch.zeros_like(x)
        """)
    tim = run_job(tmp_path, "timing", path, row=ROW)
    assert tim["status"] == "ok" and tim["failure"] is None, tim
    assert tim["reference"]["median_ms"] < 500, tim["reference"]  # three sleeping layer norms: 1.5 s
    assert len(tim["reference"]["round_medians_ms"]) == len(tim["optimized"]["round_medians_ms"]) == 3


# ------------------------------------------------------------------ the data the child hands over


def test_plain_tensor_data_round_trips_every_dtype(tmp_path):
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        out = torch.randn(2, 3, 4).to(dtype)
        handed = write_plain(host_copy(out.transpose(0, 1).contiguous().transpose(0, 1)), tmp_path / "out")
        back = read_plain(tmp_path / "out", handed, (2, 3, 4), str(dtype).removeprefix("torch."), "forward (trial 0)")
        assert type(back) is torch.Tensor and back.dtype == dtype and torch.equal(back, out)


@pytest.mark.parametrize("damage, says", [
    ("short", "not a regular file of 96 bytes (95 bytes)"),
    ("link", "cannot be opened"),
    ("dtype", "dtype float16 shape (2, 3, 4) (expected float32 (2, 3, 4))"),
    ("shape", "dtype float32 shape (3, 2, 4) (expected float32 (2, 3, 4))"),
    ("garbage", "no dtype and shape"),
])
def test_handed_over_data_that_does_not_match_is_a_named_wrong_output(tmp_path, damage, says):
    path = tmp_path / "out"
    handed = write_plain(host_copy(torch.randn(2, 3, 4)), path)
    if damage == "short":
        path.write_bytes(path.read_bytes()[:-1])
    elif damage == "link":
        os.replace(path, tmp_path / "elsewhere")
        path.symlink_to(tmp_path / "elsewhere")
    elif damage == "dtype":
        handed["dtype"] = "float16"
    elif damage == "shape":
        handed["shape"] = [3, 2, 4]
    else:
        handed = {"dtype": "float32", "shape": "2,3,4"}
    with pytest.raises(CandidateFailed) as failed:
        read_plain(path, handed, (2, 3, 4), "float32", "forward (trial 1)")
    assert (failed.value.kind, failed.value.stage) == ("wrong-output", "forward (trial 1)")
    assert says in failed.value.message and str(path) in failed.value.message


def test_only_a_plain_dense_tensor_passes_the_output_check():
    x = torch.zeros(2, 3, 4)

    class Mine(torch.Tensor):
        pass

    for out, says in ((torch.zeros(2, 3, 4).as_subclass(Mine), "Mine, a torch.Tensor subclass"),
                      (torch.nn.Parameter(torch.zeros(2, 3, 4)), "torch.nn.parameter.Parameter, a torch.Tensor"),
                      (torch.zeros(2, 3, 4).to_sparse(), "torch.sparse_coo tensor: only a dense"),
                      ([1.0], "returned a list")):
        with pytest.raises(CandidateFailed) as failed:
            check_output(out, x, "forward (trial 0)", x._version)
        assert failed.value.kind == "wrong-output" and says in failed.value.message, failed.value.message
    check_output(torch.zeros(2, 3, 4), x, "forward (trial 0)", x._version)


def test_the_candidates_process_counts_as_the_jobs_own_in_a_contention_check(monkeypatch):
    from shapewise.jobs import timing

    class Child(timing.Timed):
        pid = 4242

        def reserved_bytes(self):
            return 1000

    monkeypatch.setattr(timing, "snapshot", lambda gpu, at: {
        "at": at, "processes": [{"pid": os.getpid()}, {"pid": 4242}, {"pid": 7}], "memory_used_bytes": 5000,
        "own_reserved_bytes": 2000, "run_jobs": None})
    models = {"optimized": Child(), "reference": timing.Local(lambda: None, torch.device("cpu"))}
    snap = timing.job_snapshot({"uuid": "GPU-x"}, "before", models)
    assert snap["processes"] == [{"pid": os.getpid()}, {"pid": 7}] and snap["own_reserved_bytes"] == 3000
    assert snap["job_child_pids"] == [4242]
    assert json.dumps(snap)
