"""model/precision.py: the cuBLAS fp32 mode set for a block and restored, under the legacy flag and under PyTorch's
per-backend setting alike (a process that used the per-backend setting refuses reads of the legacy flag), and the
chunked reference, which runs its matmuls in exact fp32 through it. Each case in a fresh interpreter: the settings
are process-wide."""

import subprocess
import sys
import textwrap

import pytest

CASE = textwrap.dedent('''
    import torch
    from shapewise.model.precision import cublas_fp32
    from shapewise.model import BaselineTransformer, TransformerConfig
    from shapewise.model.chunked import chunked_reference_forward

    matmul = torch.backends.cuda.matmul
    SETUP
    per_backend = hasattr(matmul, "fp32_precision")
    read = (lambda: matmul.fp32_precision) if per_backend else (lambda: matmul.allow_tf32)
    before = read()
    for tf32 in (True, False):
        with cublas_fp32(tf32):
            inside = read()
            assert inside == (("tf32" if tf32 else "ieee") if per_backend else tf32), inside
        assert read() == before, (read(), before)
    cfg = TransformerConfig(batch_size=1, seq_len=5, d_model=16, num_heads=2, ffn_dim=32, num_layers=1)
    model = BaselineTransformer(cfg)
    x = torch.randn(1, 5, 16)
    with torch.no_grad():
        out = chunked_reference_forward(model, x, None, query_block=2)
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    assert read() == before
    print("ok", before)
''')


@pytest.mark.parametrize("setup", [
    "pass",
    "torch.backends.cuda.matmul.allow_tf32 = True",  # the legacy flag, as the pipeline's jobs set it
    "torch.set_float32_matmul_precision('high')",
    "matmul.fp32_precision = 'tf32' if hasattr(matmul, 'fp32_precision') else None",  # the per-backend setting
])
def test_the_mode_is_set_inside_and_restored_after(setup):
    done = subprocess.run([sys.executable, "-c", CASE.replace("SETUP", setup)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout + done.stderr
