"""The least a one-kernel sparse layer must do, as Triton kernels on the `tensorcore` backend's
grid (programs = pixel tiles of BLOCK_M output pixels x groups of BLOCK_K output channels): launch,
read the input it needs once, write its output once, and (with `indexed`) load its group's unit row
before the input, the one dependent load a kernel whose units are data cannot avoid. No MMA. Meant
as a floor under any kernel that reads and writes the same bytes with the same dependency chain; as
written they are not one: on an H200 they ran slower than `tensorcore` itself on most DLMC layers
(RESULTS.md; this channel-share reduction reads narrow rows per program). Only the
launch-only kernel's time bounds anything (`tensorcore_floor_probe.py` times them beside cuDNN and
`tensorcore`).

Each program (m, g) reads, for its BLOCK_M output pixels, the input pixel under the kernel's centre
tap, channels [g * share, (g + 1) * share) (share = ceil(C / groups)), so that over all groups
every needed input value of a stride-1 layer is read once (a strided 3x3 layer reads fewer than its
taps need); it writes y[m, k] = the sum of its channels for every k of its group.
"""
import torch
import triton
import triton.language as tl

BLOCK_M = 64
BLOCK_K = 64


@triton.jit
def _floor_kernel(x_ptr, unit_rows_ptr, y_ptr, M, C, K, P, Q, H, W, stride, pad, share,
                  INDEXED: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    group = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = rows % Q
    p = (rows // Q) % P
    n = rows // (P * Q)
    pixels = (n * H + p * stride + pad) * W + q * stride + pad   # the centre tap's input pixel
    first = group * share
    if INDEXED:  # the group's first channel from memory, as the kernel loads its unit row
        first = tl.load(unit_rows_ptr + group)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    for offset in range(0, share, BLOCK_C):
        channels = first + offset + tl.arange(0, BLOCK_C)
        keep = (rows[:, None] < M) & (channels[None, :] < first + share) & (channels[None, :] < C)
        values = tl.load(x_ptr + pixels[:, None] * C + channels[None, :], mask=keep, other=0.0)
        total += tl.sum(values.to(tl.float32), axis=1)
    outputs = group * BLOCK_K + tl.arange(0, BLOCK_K)
    tile = tl.broadcast_to(total[:, None], (BLOCK_M, BLOCK_K))
    tl.store(y_ptr + rows[:, None] * K + outputs[None, :], tile.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (outputs[None, :] < K))


@triton.jit
def _launch_only_kernel(sink_ptr):
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):  # one store, so the kernel is not empty
        tl.store(sink_ptr, 0.0)


def grid(spec):
    """(pixel tiles, channel groups) of `spec` (a ConvSpec) at BLOCK_M x BLOCK_K."""
    return triton.cdiv(spec.N * spec.P * spec.Q, BLOCK_M), triton.cdiv(spec.K, BLOCK_K)


def channel_share(spec) -> int:
    """Input channels each group reads: ceil(C / groups)."""
    return triton.cdiv(spec.C, grid(spec)[1])


def floor_layer(x: torch.Tensor, spec, indexed: bool) -> torch.Tensor:
    """The floor kernel on x (N, C, H, W) channels_last; returns y (N*P*Q, K) in x's dtype.
    spec: the layer (its R, S and padding place the centre tap)."""
    if x.shape != (spec.N, spec.C, spec.H, spec.W) or not x.is_contiguous(memory_format=torch.channels_last):
        raise ValueError(f"x must be {(spec.N, spec.C, spec.H, spec.W)} in channels_last memory, got "
                         f"{tuple(x.shape)} with strides {x.stride()}")
    if spec.padding[0] != spec.R // 2 or spec.padding[1] != spec.S // 2 or spec.stride[0] != spec.stride[1]:
        raise ValueError(f"the floor places the centre tap of 'same'-padded square-strided layers, got {spec}")
    tiles, groups = grid(spec)
    share = channel_share(spec)
    y = torch.empty(spec.N * spec.P * spec.Q, spec.K, device=x.device, dtype=x.dtype)
    unit_rows = torch.arange(groups, device=x.device, dtype=torch.int32) * share
    block_c = max(16, min(64, triton.next_power_of_2(share)))
    offset = spec.R // 2 - spec.padding[0]   # 0 for 'same' padding
    _floor_kernel[(tiles, groups)](x, unit_rows, y, y.shape[0], spec.C, spec.K, spec.P, spec.Q, spec.H, spec.W,
                                   spec.stride[0], offset, share, INDEXED=indexed, BLOCK_C=block_c,
                                   BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K)
    return y


def launch_only(spec, sink: torch.Tensor) -> None:
    """A kernel of `spec`'s grid whose programs do nothing (one of them stores to `sink`)."""
    _launch_only_kernel[grid(spec)](sink)


def floor_reference(x: torch.Tensor, spec) -> torch.Tensor:
    """What `floor_layer` computes, in float64 on x's device."""
    centre = x.double()[:, :, ::spec.stride[0], ::spec.stride[1]][:, :, :spec.P, :spec.Q]
    rows = centre.permute(0, 2, 3, 1).reshape(-1, spec.C)
    share = channel_share(spec)
    sums = torch.stack([rows[:, g * share:(g + 1) * share].sum(1) for g in range(grid(spec)[1])], 1)
    return sums.repeat_interleave(BLOCK_K, dim=1)[:, :spec.K]
