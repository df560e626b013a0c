"""A candidate's child is contained: every process it starts ends with its job (a new session included), it
writes nowhere but its own scratch directory, its compile caches and /dev where the kernel offers Landlock (and
the job records it unconfined where not), and its log is capped. Before, a `setsid` grandchild outlived the run
and rewrote shapewise's results, and a chatty candidate's log grew without bound."""

import json
import os
import subprocess
import textwrap
import time

import pytest

import test_candidates
from shapewise.inputs.manifest import normalize_row
from shapewise.jobs.candidate import contain

ROW = normalize_row({"id": "contained-row", "batch_size": 1, "seq_len": 4, "d_model": 16, "num_heads": 2,
                     "ffn_dim": 32, "num_layers": 1, "trials": 1})
LANDLOCK = contain.landlock_abi()
needs_landlock = pytest.mark.skipif(LANDLOCK < 1, reason="this kernel offers no Landlock "
                                    "(landlock_create_ruleset with LANDLOCK_CREATE_RULESET_VERSION failed)")


def run_job(monkeypatch, tmp_path, step, path, passed=()):
    """test_candidates.run_job, with the SHAPEWISE_* variables `passed` as config pass_env passes them (NAME=VALUE),
    also returning what the job printed (its log)."""
    done = []
    real = subprocess.run

    def run(command, *args, **kwargs):
        for item in passed:
            command = [*command, "--env", item]
        done.append(real(command, *args, **kwargs))
        return done[-1]

    monkeypatch.setattr(test_candidates.subprocess, "run", run)
    result = test_candidates.run_job(tmp_path, step, path, row=ROW)
    monkeypatch.setattr(test_candidates.subprocess, "run", real)
    return result, done[-1]


def candidate(tmp_path, name, body):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return path


def alive(pid):
    """Whether `pid` runs (a zombie, dead but not reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rpartition(b")")[2].split()[0] != b"Z"
    except OSError:
        return False


# ------------------------------------------------------------------ processes


@pytest.mark.parametrize("step", ["accuracy", "profile"])
def test_a_setsid_grandchild_is_gone_when_the_job_returns(monkeypatch, tmp_path, step):
    path = candidate(tmp_path, "escapes", """
        import os
        import subprocess
        import sys

        from shapewise.model import BaselineTransformer

        # a grandchild in a session of its own, out of the child's process group, sleeping forever
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(100000)"],
                                      start_new_session=True)
        read, write = os.pipe()
        if os.fork() == 0:  # a second, double-forked escapee: its parent exits at once
            os.setsid()
            if os.fork() == 0:
                os.write(write, str(os.getpid()).encode())
                os.close(write)
                import time
                time.sleep(100000)
            os._exit(0)
        os.close(write)
        escaped = [grandchild.pid, int(os.read(read, 64))]
        print("ESCAPED", escaped, flush=True)


        class UserOptimizedTransformer(BaselineTransformer):
            pass
        """)
    result, done = run_job(monkeypatch, tmp_path, step, path)
    line = next(x for x in done.stdout.splitlines() if x.startswith("ESCAPED"))
    pids = json.loads(line.split(" ", 1)[1])
    assert len(pids) == 2
    assert result["status"] in ("pass", "ok"), result
    assert result["containment"]["processes"] == "subreaper"
    assert result["containment"]["descendants_ended"] >= 2 and result["containment"]["descendants_left"] == []
    for pid in pids:
        assert not alive(pid), f"the candidate's process {pid} outlived its job"


def test_end_descendants_kills_an_orphan_of_a_new_session():
    """In this process: a subreaper's orphaned grandchild (its parent gone, itself in a new session) is found
    through /proc and ended."""
    assert contain.become_subreaper()
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read)
        if os.fork() == 0:
            os.setsid()
            os.write(write, str(os.getpid()).encode())
            time.sleep(100000)
        os._exit(0)
    os.close(write)
    orphan = int(os.read(read, 64))
    os.close(read)
    os.waitpid(child, 0)
    deadline = time.monotonic() + 5
    while contain._parent(orphan) != os.getpid() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert orphan in contain.descendants()
    ended = contain.end_descendants()
    assert ended["left"] == [] and ended["ended"] >= 1
    assert not alive(orphan)


# ------------------------------------------------------------------ writes

WRITER = """
    import errno
    import json
    import os
    from pathlib import Path

    from shapewise.model import BaselineTransformer

    found = {{}}
    for what, target in {targets!r}.items():
        try:
            with open(target, "a") as fh:
                fh.write("written by the candidate\\n")
            found[what] = "written"
        except OSError as exc:
            found[what] = errno.errorcode.get(exc.errno, str(exc.errno))
    for what in ("TMPDIR", "TRITON_CACHE_DIR"):  # where it may write
        try:
            (Path(os.environ[what]) / "mine").write_text("x")
            found[what] = "written"
        except OSError as exc:
            found[what] = errno.errorcode.get(exc.errno, str(exc.errno))
    print("WRITES " + json.dumps(found), flush=True)


    class UserOptimizedTransformer(BaselineTransformer):
        pass
    """


def targets(tmp_path):
    (tmp_path / "results" / "timing").mkdir(parents=True)
    (tmp_path / "results" / "report").mkdir(parents=True)
    (tmp_path / "results" / "report" / "report.html").write_text("<html>the previous report</html>\n")
    return {"results": str(tmp_path / "results" / "timing" / "shapewise.json"),
            "report": str(tmp_path / "results" / "report" / "report.html"),
            "checkout": str(tmp_path / "Snakefile")}


def writes_of(done):
    line = next(x for x in done.stdout.splitlines() if x.startswith("WRITES "))
    return json.loads(line.split(" ", 1)[1])


@needs_landlock
@pytest.mark.parametrize("step", ["accuracy", "timing", "profile"])
def test_a_confined_candidate_cannot_write_into_results_the_report_or_the_checkout(monkeypatch, tmp_path, step):
    want = targets(tmp_path)
    path = candidate(tmp_path, "writer", WRITER.format(targets=want))
    result, done = run_job(monkeypatch, tmp_path, step, path)
    assert writes_of(done) == {"results": "EACCES", "report": "EACCES", "checkout": "EACCES",
                               "TMPDIR": "written", "TRITON_CACHE_DIR": "written"}
    assert not os.path.exists(want["results"]) and not os.path.exists(want["checkout"])
    assert (tmp_path / "results" / "report" / "report.html").read_text() == "<html>the previous report</html>\n"
    assert result["status"] in ("pass", "ok"), result  # what the job itself writes is put in place
    record = result["containment"]
    assert record["writes"] == "landlock" and record["abi"] == LANDLOCK
    assert str((tmp_path / ".snakemake" / "candidate-cache" / "cand").resolve()) in record["writable"]
    if step == "profile":
        assert (tmp_path / "kernels.csv").is_file() and (tmp_path / "trace.json").is_file()


def test_where_confinement_is_off_the_candidate_is_recorded_unconfined_and_the_report_says_so(monkeypatch,
                                                                                              tmp_path):
    want = targets(tmp_path)
    path = candidate(tmp_path, "writer", WRITER.format(targets=want))
    result, done = run_job(monkeypatch, tmp_path, "accuracy", path, passed=[f"{contain.SWITCH}=off"])
    assert writes_of(done)["results"] == "written"  # unconfined: it can, and the record says so
    record = result["containment"]
    assert record["writes"] == "unconfined" and contain.SWITCH in record["reason"]
    assert record["processes"] == "subreaper"

    from shapewise.report.report_candidates import containment_notes
    assert containment_notes({"accuracy": result, "timing": {}, "profile": {}}) == [
        f"ran unconfined [accuracy job]: its writes were not restricted ({record['reason']})"]


def test_the_plan_falls_back_to_unconfined_where_the_kernel_offers_no_landlock(monkeypatch, tmp_path):
    monkeypatch.setattr(contain, "landlock_abi", lambda: 0)
    decided = contain.plan([tmp_path], environ={})
    assert decided["writes"] == "unconfined" and "no Landlock" in decided["reason"]
    contain.confine(decided)  # nothing to apply: the child runs on
    if LANDLOCK:
        monkeypatch.undo()
        assert contain.plan([tmp_path], environ={}) == {"writes": "landlock", "abi": LANDLOCK,
                                                        "writable": [str(tmp_path.resolve())]}


# ------------------------------------------------------------------ output


def test_a_chatty_candidates_log_keeps_its_first_and_last_part(monkeypatch, tmp_path):
    path = candidate(tmp_path, "chatty", """
        import os
        import sys

        from shapewise.model import BaselineTransformer

        sys.stdout.write("FIRST LINE\\n")
        for _ in range(24):  # 24 MiB, three times the cap
            sys.stdout.buffer.write((b"y" * 1023 + b"\\n") * 1024)
        sys.stdout.flush()
        sys.stderr.write("LAST LINE\\n")
        sys.stderr.flush()


        class UserOptimizedTransformer(BaselineTransformer):
            pass
        """)
    result, done = run_job(monkeypatch, tmp_path, "accuracy", path)
    assert result["status"] == "pass", result
    log = done.stdout + done.stderr
    cap = contain.LOG_HEAD_BYTES + contain.LOG_TAIL_BYTES
    assert len(log.encode()) < cap + (64 << 10), len(log)
    assert "FIRST LINE" in log and "LAST LINE" in log
    assert result["containment"]["log"]["bytes"] > 24 << 20
    dropped = result["containment"]["log"]["dropped_bytes"]
    assert dropped == result["containment"]["log"]["bytes"] - cap
    assert f"[shapewise: {dropped} bytes of the candidate's output dropped here" in log


def test_the_log_cap_passes_a_quiet_childs_output_whole(tmp_path):
    read, write = os.pipe()
    out = os.open(tmp_path / "log", os.O_WRONLY | os.O_CREAT)
    cap = contain.LogCap(read, out, head=10, tail=6)
    os.write(write, b"0123456789abcdef")  # 16 bytes: head and tail exactly, nothing dropped
    os.close(write)
    assert cap.close() == {"bytes": 16, "dropped_bytes": 0}
    os.close(out)
    assert (tmp_path / "log").read_bytes() == b"0123456789abcdef"
