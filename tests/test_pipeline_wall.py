"""benchmarks.pipeline_wall's rerun helpers: one field of one manifest row edited, the jobs a Snakemake log started."""
import json
import types

import pytest
import yaml

from benchmarks import pipeline_wall as pw

MANIFEST = """# a comment
- {id: a-01, batch_size: 2, seq_len: 32, d_model: 64, num_heads: 2, ffn_dim: 64, num_layers: 1}
- {id: a-02, batch_size: 2, seq_len: 32, d_model: 64, num_heads: 2, ffn_dim: 64, num_layers: 1}
"""


def test_an_edit_changes_that_field_of_that_row_alone():
    before, after = yaml.safe_load(MANIFEST), yaml.safe_load(pw.edited_manifest(MANIFEST, "a-02", "seq_len", "48"))
    assert after[0] == before[0] and after[1] == {**before[1], "seq_len": 48}


@pytest.mark.parametrize("row", ["a-03", "a"])
def test_an_edit_of_a_row_the_manifest_lacks_names_it(row):
    with pytest.raises(SystemExit, match=repr(row)):
        pw.edited_manifest(MANIFEST, row, "seq_len", "48")


def test_the_jobs_a_log_started_are_counted_by_rule(tmp_path):
    log = tmp_path / "snakemake.log"
    log.write_text("Building DAG of jobs...\n\nrule timing:\n    input: x\n\nlocalrule report:\n\nrule timing:\n"
                   "    rule timing: not a start\nNothing to be done.\n")
    assert pw.jobs_run(log) == {"timing": 2, "report": 1}
    log.write_text("Nothing to be done (all requested files are present and up to date).\n")
    assert pw.jobs_run(log) == {}


def test_reruns_run_unchanged_then_edited_and_restore_the_manifest(tmp_path, monkeypatch):
    (tmp_path / "shapes").mkdir()
    manifest = tmp_path / "shapes" / "mine.yaml"
    manifest.write_text(MANIFEST)
    seen = []

    def run(args, extra, log_path):
        seen.append(yaml.safe_load(manifest.read_text())[1]["seq_len"])
        log_path.write_text("rule timing:\n" * (len(seen) - 1))
        return {"wall_s": 1.5, "exit_status": 0}

    monkeypatch.setattr(pw, "ROOT", tmp_path)
    monkeypatch.setattr(pw, "run_snakemake", run)
    args = types.SimpleNamespace(shapes="mine")
    done = pw.reruns(args, [], tmp_path, "a-02:seq_len=48")
    assert seen == [32, 48] and manifest.read_text() == MANIFEST
    assert [(r["what"], r["jobs"]) for r in done] == [("nothing changed", {}), ("a-02 seq_len=48", {"timing": 1})]
    with pytest.raises(SystemExit, match="'a-09'"):
        pw.reruns(args, [], tmp_path, "a-09:seq_len=48")
    assert len(seen) == 2  # a row the manifests lack is refused before any run


def test_reruns_only_needs_a_complete_run_and_writes_its_own_file(tmp_path, monkeypatch):
    (tmp_path / "shapes").mkdir()
    (tmp_path / "shapes" / "mine.yaml").write_text(MANIFEST)
    parts = tmp_path / "results" / "pipeline-wall.json"
    monkeypatch.setattr(pw, "ROOT", tmp_path)
    monkeypatch.setattr(pw, "PARTS", parts)
    monkeypatch.setattr(pw, "run_snakemake", lambda args, extra, log_path: log_path.write_text("") and None
                        or {"wall_s": 2.0, "exit_status": 0})
    args = types.SimpleNamespace(shapes="mine", reruns="a-01:seq_len=16", fresh=False)
    with pytest.raises(SystemExit, match="needs a complete run"):
        pw.reruns_only(args, [], tmp_path)
    parts.parent.mkdir()
    parts.write_text('{"parts": [{"wall_s": 300.0, "complete": false}]}')
    with pytest.raises(SystemExit, match="needs a complete run"):
        pw.reruns_only(args, [], tmp_path)
    parts.write_text('{"parts": [{"wall_s": 300.0, "complete": true}]}')
    assert pw.reruns_only(args, [], tmp_path) == 0
    done = json.loads((tmp_path / "pipeline-wall-reruns.json").read_text())
    assert done["after"]["wall_s"] == 300.0 and [r["what"] for r in done["reruns"]] == ["nothing changed",
                                                                                        "a-01 seq_len=16"]
