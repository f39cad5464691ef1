"""The epilogue every Triton conv kernel ends with: y = act(acc + residual), stored in y's dtype."""
import triton
import triton.language as tl


@triton.jit
def store_epilogue(acc, y_ptr, res_ptr, y_offs, mask, HAS_RESIDUAL: tl.constexpr, RELU: tl.constexpr):
    """acc: fp32 tile (bias already added); y_offs / mask: the tile's output offsets and valid
    lanes; res_ptr: the residual (same layout as y), read only when HAS_RESIDUAL."""
    if HAS_RESIDUAL:
        acc += tl.load(res_ptr + y_offs, mask=mask, other=0.0).to(tl.float32)
    if RELU:
        acc = tl.maximum(acc, 0.0)
    tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=mask)
