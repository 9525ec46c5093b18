"""float32 -> bfloat16 rounding inside Triton kernels, shared by the kernels that write
bfloat16 (the flat AdamW's compute copies, the tied embedding's gradient rows)."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: no kernels
    triton = None

if triton is not None:

    @triton.jit
    def to_bf16(x):
        """float32 -> bfloat16 rounded to nearest even, as torch's cast (by its bits: the
        interpreter's own cast truncates)."""
        bits = x.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
