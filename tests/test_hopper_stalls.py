"""benchmarks/hopper_stalls.py's summary of Nsight Compute's CSV pages, on a few lines in their format (CPU)."""
import json

from benchmarks.hopper_stalls import summarize

DETAILS = '''"ID","Process ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","_hopper_forward_fwd","GPU Speed Of Light Throughput","Duration","us","88.93"
"0","1","_hopper_forward_fwd","GPU Speed Of Light Throughput","SM Frequency","Ghz","1.75"
"0","1","_hopper_forward_fwd","Launch Statistics","Registers Per Thread","register/thread","227"
"0","1","_hopper_forward_fwd","Scheduler Statistics","No Eligible","%","66.62"
'''
SOURCE = '''"Kernel Name","_hopper_forward_fwd",
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","stall_long_sb","stall_barrier","stall_long_sb (Not Issued)"
"0x10","      LDG.E.64 R28, desc[UR16][R20.64]","1","0","0","0","0"
"0x20","      FADD R185, R58, R28","85","85","85","0","85"
"0x30","@P4   BAR.SYNC.DEFER_BLOCKING 0x0","6","6","0","6","0"
"0x40","      FADD R184, R56, R28","2","1","1","0","1"
'''


def test_the_summary_counts_samples_by_reason_opcode_and_instruction(tmp_path):
    (tmp_path / "row01-details.csv").write_text(DETAILS)
    (tmp_path / "row01-source.csv").write_text(SOURCE)
    out = summarize(tmp_path)
    (row,) = out["rows"]
    assert row["row"] == "row01" and row["Duration [us]"] == 88.93 and row["No Eligible [%]"] == 66.62
    assert "SM Frequency [Ghz]" not in row  # only the metrics the summary names
    assert row["samples"] == 94
    assert row["samples_by_opcode"] == {"FADD": 87, "BAR": 6, "LDG": 1}  # a predicate is not an opcode
    assert row["samples_by_reason"]["stall_long_sb"] == 86 and row["samples_by_reason"]["stall_barrier"] == 6
    assert row["top_instructions"][0]["sass"] == "FADD R185, R58, R28" and row["top_instructions"][0]["share"] == 0.9043
    assert json.loads((tmp_path / "summary.json").read_text()) == out


def test_split_mode_samples_the_split_layers_kernel(tmp_path, monkeypatch):
    """`--split tail`: Nsight Compute filters on the Hopper tail's kernel and the profiled process launches it."""
    import benchmarks.hopper_stalls as hs

    commands = []
    monkeypatch.setattr(hs, "ncu_path", lambda: "ncu")
    monkeypatch.setattr(hs.subprocess, "run", lambda cmd, **kw: commands.append(cmd))
    hs.profile(tmp_path, 13, None, split="tail")
    sample = commands[0]
    assert sample[sample.index("--kernel-name") + 1] == "regex:_layer_tail_hopper_fwd"
    assert sample[-2:] == ["--split", "tail"] and "--launch" in sample
    empty = tmp_path / "none"
    empty.mkdir()
    assert hs.summarize(empty, hs.SPLIT_KERNELS["ln_qkv"]) == {"kernel": "_ln_qkv_hopper_fwd", "rows": []}
