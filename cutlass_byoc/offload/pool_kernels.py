"""The Triton kernels of the max-pool ops (pooling.py): the forward, which writes each window's maximum and where in
the window it was (an int8 offset, kh * KW + kw), and the backward, which gathers each input element's gradient from
the windows whose maximum it was.

Why a kernel of our own for the backward: Inductor's joint graph keeps no offsets, so its backward recomputes every
window's maximum from the saved input (and then gathers over the input, lowering aten's op, or scatters with atomic
adds into an fp32 buffer, PyTorch's decomposition of it): on ResNet-50 training under CUDA graphs the stem's
max-pool backward took 0.18 ms (batch 32) and 0.36 ms (batch 64) on an H100, where reading the gradient and the
offsets and writing the input's gradient moves ~70 MB at batch 32 (~25 us). The forward, as Inductor's, reads every
window; it also writes the offsets the backward reads.

Semantics are ATen's (``max_pool2d_with_indices``): a window's maximum is its first largest element in row-major
order, a NaN wins and a later NaN wins over an earlier one; a window whose elements are all -inf takes its first
element inside the input. The backward adds the gradients of the windows of an element in ATen's order (window rows,
then columns, ascending) in fp32 and stores the input's dtype.

Layouts: any strides (the pointers are computed from them); a block is BLOCK_P positions by BLOCK_C channels, so
channels_last tensors (channels contiguous) load and store in whole lines. Offsets are int32 arithmetic on the
positions, an image's start in int64 and offsets inside an image in int32 (pooling.int32_holds: tensors past
2**31 elements take ATen's pooling).

Two backward kernels: the cell kernel (cb_max_pool2d_bwd_cells), for pools whose windows overlap at most two in a
row (ResNet's 3x3 stride 2, 2x2 stride 2, ...), and the gather over taps (cb_max_pool2d_bwd) for every other pool.
The gather tries every tap of every window that could hold an element, with a masked load each, and is bound by
those instructions; a cell of stride x stride input elements loads the four windows that can hold them once, their
taps known at compile time. On ResNet-50's stem pool on an H100 (scripts/pool_bench.py, thirty-eighth session): the
gather 108.5 / 213.8 us at batch 32 / 64, the cell kernel 30.4 / 58.5 us (bitwise the gather's result), Inductor's
backward 181.8 / 361.6 us. Both kernels take a second gradient (TWO: the windows' gradient is g + g2, added in fp32),
the sum the rewrite folds in: the cell kernel then took 35.0 / 66.5 us, where the add alone is a 15.7 / 28.3 us
kernel. CUTLASS_BYOC_POOL_CELLS=0 (or cells=False) runs the gather everywhere.

The kernels are named cb_... so that the offload bench's profile counts them as this project's (bench.KERNEL_SOURCES).
Triton is imported here only: the ops fall back to ATen where it is missing (pooling.py).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

#: the backward's cell kernel for the pools it takes (see above)
CELLS = os.environ.get("CUTLASS_BYOC_POOL_CELLS", "1") == "1"
#: positions x channels a program covers (channels: the next power of two up to this)
BLOCK_ELEMS = 2048
MAX_BLOCK_C = 64


@triton.jit
def _block(count, C, A, B, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's block: BLOCK_P positions of an N x A x B grid (count of them), as (n, a, b), and BLOCK_C
    channels, with their masks."""
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    pmask = p < count
    cmask = c < C
    b = p % B
    t = p // B
    a = t % A
    n = (t // A).to(tl.int64)
    return n, a, b, pmask, c, cmask


@triton.jit
def cb_max_pool2d_fwd(x_ptr, val_ptr, off_ptr, C, H, W, PH, PW, positions,
                    sxn, sxc, sxh, sxw, svn, svc, svh, svw,
                    KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                    PADH: tl.constexpr, PADW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
                    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    n, ph, pw, pmask, c, cmask = _block(positions, C, PH, PW, BLOCK_P, BLOCK_C)
    cx = c.to(tl.int64) * sxc
    best = tl.full([BLOCK_P, BLOCK_C], float("-inf"), tl.float32)
    off = tl.full([BLOCK_P, BLOCK_C], -1, tl.int32)
    for kh in tl.static_range(KH):
        ih = ph * SH - PADH + kh * DH
        hok = pmask & (ih >= 0) & (ih < H)
        for kw in tl.static_range(KW):
            iw = pw * SW - PADW + kw * DW
            ok = hok & (iw >= 0) & (iw < W)
            m = ok[:, None] & cmask[None, :]
            row = n * sxn + ih.to(tl.int64) * sxh + iw.to(tl.int64) * sxw
            v = tl.load(x_ptr + row[:, None] + cx[None, :], mask=m, other=float("-inf")).to(tl.float32)
            # ATen's rule: a larger value or a NaN replaces the maximum; the first element inside the input is taken
            # whatever it is (a window of -inf keeps it)
            take = m & ((v > best) | (v != v) | (off < 0))
            best = tl.where(take, v, best)
            off = tl.where(take, kh * KW + kw, off)
    out = n * svn + ph.to(tl.int64) * svh + pw.to(tl.int64) * svw
    dst = out[:, None] + (c.to(tl.int64) * svc)[None, :]
    m = pmask[:, None] & cmask[None, :]
    tl.store(val_ptr + dst, best.to(val_ptr.dtype.element_ty), mask=m)
    tl.store(off_ptr + dst, off.to(tl.int8), mask=m)


@triton.jit
def cb_max_pool2d_bwd(g_ptr, off_ptr, gi_ptr, C, H, W, PH, PW, positions,
                    sgn, sgc, sgh, sgw, son, soc, soh, sow, sin, sic, sih, siw,
                    g2_ptr, s2n, s2c, s2h, s2w,
                    KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                    PADH: tl.constexpr, PADW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
                    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, TWO: tl.constexpr):
    # TWO: the windows' gradient is the sum of two tensors (g and g2), added here in fp32
    n, ih, iw, qmask, c, cmask = _block(positions, C, H, W, BLOCK_P, BLOCK_C)
    cg = c.to(tl.int64) * sgc
    co = c.to(tl.int64) * soc
    acc = tl.zeros([BLOCK_P, BLOCK_C], tl.float32)
    # window rows ascending (kh descending), then columns ascending: ATen's order of the sum
    for i in tl.static_range(KH):
        kh = KH - 1 - i
        th = ih + PADH - kh * DH
        thc = tl.maximum(th, 0)
        ph = thc // SH
        hok = qmask & (th >= 0) & (thc % SH == 0) & (ph < PH)
        for j in tl.static_range(KW):
            kw = KW - 1 - j
            tw = iw + PADW - kw * DW
            twc = tl.maximum(tw, 0)
            pw = twc // SW
            ok = hok & (tw >= 0) & (twc % SW == 0) & (pw < PW)
            m = ok[:, None] & cmask[None, :]
            ph64 = ph.to(tl.int64)
            pw64 = pw.to(tl.int64)
            orow = n * son + ph64 * soh + pw64 * sow
            o = tl.load(off_ptr + orow[:, None] + co[None, :], mask=m, other=-1).to(tl.int32)
            hit = m & (o == kh * KW + kw)
            grow = n * sgn + ph64 * sgh + pw64 * sgw
            gw = tl.load(g_ptr + grow[:, None] + cg[None, :], mask=hit, other=0.0).to(tl.float32)
            if TWO:
                row2 = n * s2n + ph64 * s2h + pw64 * s2w
                gw += tl.load(g2_ptr + row2[:, None] + (c.to(tl.int64) * s2c)[None, :], mask=hit,
                              other=0.0).to(tl.float32)
            acc += gw
    dst = n * sin + ih.to(tl.int64) * sih + iw.to(tl.int64) * siw
    m = qmask[:, None] & cmask[None, :]
    tl.store(gi_ptr + dst[:, None] + (c.to(tl.int64) * sic)[None, :], acc.to(gi_ptr.dtype.element_ty), mask=m)


@triton.jit
def _window(g_img, off_img, ph, pw, PH, PW, pmask, cmask, sgh, sgw, soh, sow, g2_img, s2h, s2w,
            TWO: tl.constexpr):
    """Window (ph, pw) of each cell (g_img, off_img, g2_img: its image's channels): its offsets (int32, -1 outside
    the output) and gradient (fp32; TWO: g's and g2's sum)."""
    ok = pmask & (ph >= 0) & (ph < PH) & (pw >= 0) & (pw < PW)
    m = ok[:, None] & cmask[None, :]
    o = tl.load(off_img + (ph * soh + pw * sow)[:, None], mask=m, other=-1)
    g = tl.load(g_img + (ph * sgh + pw * sgw)[:, None], mask=m, other=0.0).to(tl.float32)
    if TWO:
        g += tl.load(g2_img + (ph * s2h + pw * s2w)[:, None], mask=m, other=0.0).to(tl.float32)
    return o.to(tl.int32), g


@triton.jit
def cb_max_pool2d_bwd_cells(g_ptr, off_ptr, gi_ptr, C, H, W, PH, PW, BH, BW, cells,
                            sgn, sgc, sgh, sgw, son, soc, soh, sow, sin, sic, sih, siw,
                            g2_ptr, s2n, s2c, s2h, s2w,
                            KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                            PADH: tl.constexpr, PADW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
                            J0H: tl.constexpr, J0W: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
                            TWO: tl.constexpr):
    # A cell (bh, bw) owns the SH x SW input elements (bh * SH + r, bw * SW + q); every window that holds one of them
    # is (bh + J0H + a, bw + J0W + b), a and b in {0, 1} (the host checks), and which window holds which element
    # with which tap is known at compile time. So a cell loads four windows' offsets and gradients once and adds
    # each into the elements whose maximum it was: ~2 loads and ~2 selects per element, where the gather over taps
    # (cb_max_pool2d_bwd) tries every tap of the window with a masked load each.
    n, bh, bw, pmask, c, cmask = _block(cells, C, BH, BW, BLOCK_P, BLOCK_C)
    g_img = g_ptr + (n * sgn)[:, None] + (c * sgc)[None, :]
    off_img = off_ptr + (n * son)[:, None] + (c * soc)[None, :]
    g2_img = g2_ptr + (n * s2n)[:, None] + (c * s2c)[None, :]
    ph0 = bh + J0H
    pw0 = bw + J0W
    o00, g00 = _window(g_img, off_img, ph0, pw0, PH, PW, pmask, cmask, sgh, sgw, soh,
                       sow, g2_img, s2h, s2w, TWO)
    o01, g01 = _window(g_img, off_img, ph0, pw0 + 1, PH, PW, pmask, cmask, sgh, sgw, soh,
                       sow, g2_img, s2h, s2w, TWO)
    o10, g10 = _window(g_img, off_img, ph0 + 1, pw0, PH, PW, pmask, cmask, sgh, sgw, soh,
                       sow, g2_img, s2h, s2w, TWO)
    o11, g11 = _window(g_img, off_img, ph0 + 1, pw0 + 1, PH, PW, pmask, cmask, sgh, sgw, soh,
                       sow, g2_img, s2h, s2w, TWO)
    gi_img = gi_ptr + (n * sin)[:, None] + (c * sic)[None, :]
    for r in tl.static_range(SH):
        ih = bh * SH + r
        for q in tl.static_range(SW):
            iw = bw * SW + q
            acc = tl.zeros([BLOCK_P, BLOCK_C], tl.float32)
            # window rows, then columns, ascending: ATen's order of the sum
            for a in tl.static_range(2):
                th = r + PADH - (J0H + a) * SH  # kh * DH, if window row a holds the element
                if th >= 0:
                    if th % DH == 0:
                        if th // DH < KH:
                            for b in tl.static_range(2):
                                tw = q + PADW - (J0W + b) * SW
                                if tw >= 0:
                                    if tw % DW == 0:
                                        if tw // DW < KW:
                                            tap = (th // DH) * KW + tw // DW
                                            if a == 0:
                                                if b == 0:
                                                    acc += tl.where(o00 == tap, g00, 0.0)
                                                else:
                                                    acc += tl.where(o01 == tap, g01, 0.0)
                                            else:
                                                if b == 0:
                                                    acc += tl.where(o10 == tap, g10, 0.0)
                                                else:
                                                    acc += tl.where(o11 == tap, g11, 0.0)
            ok = pmask & (ih < H) & (iw < W)
            tl.store(gi_img + (ih * sih + iw * siw)[:, None], acc.to(gi_ptr.dtype.element_ty),
                     mask=ok[:, None] & cmask[None, :])


def cell_windows(k: int, s: int, p: int, d: int) -> Optional[int]:
    """J0 of one dimension for cb_max_pool2d_bwd_cells: the first window, relative to a cell, that holds one of the
    cell's s input elements, if the windows holding them are at most two (J0 and J0 + 1), else None."""
    lo = min(-((-(r + p - (k - 1) * d)) // s) for r in range(s))  # ceil((r + p - (k - 1) d) / s)
    hi = max((r + p) // s for r in range(s))
    return lo if hi - lo <= 1 else None


def _blocks(channels: int) -> tuple[int, int]:
    block_c = min(MAX_BLOCK_C, triton.next_power_of_2(max(channels, 1)))
    return BLOCK_ELEMS // block_c, block_c


def max_pool2d_fwd(x: torch.Tensor, vals: torch.Tensor, offsets: torch.Tensor, kernel, stride, padding,
                   dilation) -> None:
    """Fill vals (N, C, PH, PW) and offsets (int8, the same shape and strides) from x (N, C, H, W)."""
    n, c, h, w = x.shape
    ph, pw = vals.shape[2:]
    positions = n * ph * pw
    if positions == 0 or c == 0:
        return
    block_p, block_c = _blocks(c)
    grid = (triton.cdiv(positions, block_p), triton.cdiv(c, block_c))
    assert vals.stride() == offsets.stride()
    cb_max_pool2d_fwd[grid](x, vals, offsets, c, h, w, ph, pw, positions, *x.stride(), *vals.stride(),
                          KH=kernel[0], KW=kernel[1], SH=stride[0], SW=stride[1], PADH=padding[0], PADW=padding[1],
                          DH=dilation[0], DW=dilation[1], BLOCK_P=block_p, BLOCK_C=block_c, num_warps=4)


def max_pool2d_bwd(grad: torch.Tensor, offsets: torch.Tensor, grad_input: torch.Tensor, kernel, stride, padding,
                   dilation, cells: Optional[bool] = None, grad2: Optional[torch.Tensor] = None) -> None:
    """Fill grad_input (N, C, H, W) from grad (N, C, PH, PW) and the forward's offsets (int8, grad's shape); grad2:
    a second gradient of grad's shape, the windows' gradient then being the two added (in fp32); cells: the cell
    kernel where it takes the pool (default CELLS), else the gather."""
    n, c, h, w = grad_input.shape
    ph, pw = grad.shape[2:]
    if n * h * w == 0 or c == 0:
        return
    block_p, block_c = _blocks(c)
    two = grad2 is not None
    second = (grad2, *grad2.stride()) if two else (grad, *grad.stride())  # unread where not two
    args = (c, h, w, ph, pw)
    consts = dict(KH=kernel[0], KW=kernel[1], SH=stride[0], SW=stride[1], PADH=padding[0], PADW=padding[1],
                  DH=dilation[0], DW=dilation[1], BLOCK_P=block_p, BLOCK_C=block_c, TWO=two, num_warps=4)
    strides = (*grad.stride(), *offsets.stride(), *grad_input.stride(), *second)
    j0h, j0w = (cell_windows(kernel[i], stride[i], padding[i], dilation[i]) for i in (0, 1))
    if (CELLS if cells is None else cells) and j0h is not None and j0w is not None:
        bh, bw = triton.cdiv(h, stride[0]), triton.cdiv(w, stride[1])
        count = n * bh * bw
        grid = (triton.cdiv(count, block_p), triton.cdiv(c, block_c))
        cb_max_pool2d_bwd_cells[grid](grad, offsets, grad_input, *args, bh, bw, count, *strides, J0H=j0h, J0W=j0w,
                                      **consts)
        return
    positions = n * h * w
    grid = (triton.cdiv(positions, block_p), triton.cdiv(c, block_c))
    cb_max_pool2d_bwd[grid](grad, offsets, grad_input, *args, positions, *strides, **consts)
