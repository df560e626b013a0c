"""shapewise Triton kernels, one op per file: attention, residual add + LayerNorm, the mask summary, the fused layer
and the layer tail (tiles.py: the device functions the layer kernels share; pdl.py: how a kernel of a forward waits
for the one before it under programmatic dependent launch); and for Hopper (sm_90) in Gluon: the whole forward
(hopper_forward.py), attention (attention_hopper.py), the linear layer (linear_hopper.py), and the split layer's
LayerNorm + QKV and tail (ln_qkv_hopper.py, layer_tail_hopper.py).

Without a GPU, set TRITON_INTERPRET=1 before importing this package to run the kernels on the CPU.
"""
import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # kernels run in Triton's CPU interpreter

# Operand precisions of the kernels' matmuls and the dtype their operands are held in ("fp32" = exact fp32 dots,
# "tf32" = fp32 operands on TF32 tensor cores): the one list of them. Accumulation is fp32 always.
OPERAND_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PRECISIONS = tuple(OPERAND_DTYPES)


def _fix_interpreter_scalar_index():
    """Triton 3.6's interpreter turns scalar tensors into Python ints with `int(array)`, which NumPy >= 2.4
    refuses for its shape-(1,) arrays ("only 0-dimensional arrays can be converted"); a loop with a
    run-time bound then fails. Convert through `.item()` instead. Only touches the interpreter."""
    try:
        from triton.runtime import interpreter  # deferred: only the interpreter's runs need it
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_shapewise_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._shapewise_fixed = True
    interpreter._patch_lang_tensor = patched


if INTERPRET:
    _fix_interpreter_scalar_index()
