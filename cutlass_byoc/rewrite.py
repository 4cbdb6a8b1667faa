"""Operand rewrites ops applies around a kernel: zero channel padding, and the space-to-depth fold of a strided conv.

Tensors follow PyTorch's logical shapes (x and dx N x C x H x W, w and dw K x C x R x S) in channels_last memory
(NHWC, KRSC); every function returns a channels_last tensor and leaves its inputs alone. Everything runs on the
current stream, so the profiler's timing of a rewritten launch (ops.run_problem) includes these copies.

Space-to-depth with block b (`config.s2d_problem`): x' is x zero-padded by (pad_h, pad_w) at the top and left (and
padded or cropped at the bottom and right to the rows the conv reads), gu = min(b, R) and gv = min(b, S) the pixel
phases any filter tap reaches (b x b, except for filters narrower than the stride: a 1x1 stride-2 conv reaches one
phase, so its fold is a plain subsample), and

    xs[n, (bu * gv + bv) * C + c, i, j] = x'[n, c, b * i + bu, b * j + bv]      (bu < gu, bv < gv)
    ws[k, (bu * gv + bv) * C + c, a, e] = w[k, c, b * a + bu, b * e + bv]       (zero where b * a + bu >= R, ...)

so that y = conv(x, w, stride b, padding) = conv(xs, ws, stride 1, padding 0) exactly: each product of the strided
conv appears once in the folded one, and the folded filter's extra taps are zeros.

On a CUDA tensor with Triton present, each rewrite of a 4-D tensor is one Triton kernel (`_fold_kernel`: every output
element gathers its source element or a zero; `_unfold_kernel`: the inverse). Otherwise (the CPU, where the tests
check the index algebra, or no Triton) the same functions run as PyTorch view copies, which on the H200 took 40-55
us around the stem's fold (several strided copies of 2-byte elements and small launches) against the ~10 us that
moving its bytes takes.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

from .config import fold_phases


def _torch():
    import torch  # noqa: PLC0415

    return torch


@functools.lru_cache(maxsize=None)
def _triton_kernels():
    """(fold, unfold) Triton kernels, or None where Triton is not installed."""
    try:
        import triton  # noqa: PLC0415
        import triton.language as tl  # noqa: PLC0415
    except ImportError:
        return None

    @triton.jit
    def fold_kernel(src, dst, pixels, rows, h, w, c, hs, ws, c_to, pad_h, pad_w, gu, gv,
                    BLK: tl.constexpr, BP: tl.constexpr, BC: tl.constexpr):
        # dst[n, i, j, (bu * gv + bv) * c + ch] = src[n, BLK * i + bu - pad_h, BLK * j + bv - pad_w, ch], or 0
        # (outside src, channels past gu * gv * c, rows n >= rows); src and dst NHWC-contiguous. A program copies
        # BP output pixels x BC channels: the pixel's coordinates are worked out once per pixel, the channel's
        # phase once per channel (int32: ops refuses problems whose extents overflow it).
        pix = tl.program_id(0) * BP + tl.arange(0, BP)
        cc = tl.program_id(1) * BC + tl.arange(0, BC)
        j = pix % ws
        t = pix // ws
        i = t % hs
        n = t // hs
        g = cc // c
        ch = cc % c
        hh = BLK * i[:, None] + (g // gv)[None, :] - pad_h
        ww = BLK * j[:, None] + (g % gv)[None, :] - pad_w
        live = (pix < pixels)[:, None] & (cc < c_to)[None, :]
        ok = live & (g < gu * gv)[None, :] & (n < rows)[:, None] & (hh >= 0) & (hh < h) & (ww >= 0) & (ww < w)
        v = tl.load(src + ((n[:, None] * h + hh) * w + ww) * c + ch[None, :], mask=ok, other=0.0)
        tl.store(dst + pix[:, None] * c_to + cc[None, :], v, mask=live)

    @triton.jit
    def unfold_kernel(src, dst, pixels, h, w, c, hs, ws, c_src, pad_h, pad_w, gu, gv,
                      BLK: tl.constexpr, BP: tl.constexpr, BC: tl.constexpr):
        # dst[n, hh, ww, ch] = src[n, (hh + pad_h) // BLK, (ww + pad_w) // BLK, (bu * gv + bv) * c + ch] with
        # bu, bv the remainders, or 0 where the fold does not reach (rows, columns or phases past it)
        pix = tl.program_id(0) * BP + tl.arange(0, BP)
        ch = tl.program_id(1) * BC + tl.arange(0, BC)
        ww = pix % w + pad_w
        t = pix // w
        hh = t % h + pad_h
        n = t // h
        i = hh // BLK
        j = ww // BLK
        bu = hh % BLK
        bv = ww % BLK
        live = (pix < pixels)[:, None] & (ch < c)[None, :]
        ok = live & ((i < hs) & (j < ws) & (bu < gu) & (bv < gv))[:, None]
        base = ((n * hs + i) * ws + j) * c_src + (bu * gv + bv) * c
        v = tl.load(src + base[:, None] + ch[None, :], mask=ok, other=0.0)
        tl.store(dst + pix[:, None] * c + ch[None, :], v, mask=live)

    return fold_kernel, unfold_kernel


#: Elements a rewrite program moves (BP pixels x BC channels).
_ELEMENTS = 4096


def _blocks(pixels: int, channels: int) -> tuple[int, int, tuple[int, int]]:
    """(BP, BC, grid) of a rewrite launch: all channels of a pixel in one program up to 512, pixels filling the rest."""
    import triton  # noqa: PLC0415

    bc = min(512, triton.next_power_of_2(max(1, channels)))
    bp = max(1, _ELEMENTS // bc)
    return bp, bc, (-(-pixels // bp), -(-channels // bc))


def _fast(*ts) -> bool:
    """Whether the Triton kernels take these 4-D tensors: on the GPU, channels_last-contiguous, under 2^31 elements
    (int32 offsets), Triton present."""
    torch = _torch()
    return all(t.is_cuda and t.is_contiguous(memory_format=torch.channels_last) and t.numel() < 2**31 for t in ts) \
        and _triton_kernels() is not None


def _on(device):
    """Triton launches on the current CUDA device (and its current stream): make it the tensors' device when it
    is another one (nothing to do for the current device, or the CPU under Triton's interpreter)."""
    torch = _torch()
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _fold(t, block: int, pad_h: int, pad_w: int, hs: int, ws: int, c_to: int, n_to: int, phases: tuple[int, int]):
    """Triton: t (logical N x C x H x W, channels_last) folded as the module docstring says into an n_to x c_to x hs x
    ws channels_last tensor (rows past N zero)."""
    torch = _torch()
    n, c, h, w = t.shape
    out = torch.empty((n_to, hs, ws, c_to), dtype=t.dtype, device=t.device)
    if out.numel() >= 2**31:
        raise ValueError(f"rewrite: {tuple(out.shape)} has 2^31 elements or more (int32 offsets)")
    pixels = n_to * hs * ws
    bp, bc, grid = _blocks(pixels, c_to)
    fold_kernel, _ = _triton_kernels()
    with _on(t.device):
        fold_kernel[grid](t, out, pixels, n, h, w, c, hs, ws, c_to, pad_h, pad_w, *phases, BLK=block, BP=bp, BC=bc)
    return out.permute(0, 3, 1, 2)


def _unfold(ts, block: int, pad_h: int, pad_w: int, out, phases: tuple[int, int]) -> None:
    """Triton: the inverse of _fold into `out` (logical N x C x H x W, channels_last; its N <= ts's)."""
    n, c, h, w = out.shape
    hs, ws, c_src = ts.shape[2], ts.shape[3], ts.shape[1]
    pixels = n * h * w
    bp, bc, grid = _blocks(pixels, c)
    _, unfold_kernel = _triton_kernels()
    with _on(out.device):
        unfold_kernel[grid](ts, out, pixels, h, w, c, hs, ws, c_src, pad_h, pad_w, *phases, BLK=block, BP=bp, BC=bc)


def pad_channels(t, dim0: Optional[int], dim1: Optional[int]):
    """`t` (4-D channels_last, or the 1-D bias) zero-padded to dim0 rows and dim1 channels (None: unchanged)."""
    torch = _torch()
    shape = list(t.shape)
    want = list(shape)
    if dim0 is not None:
        want[0] = dim0
    if dim1 is not None and t.dim() > 1:
        want[1] = dim1
    if want == shape:
        return t
    if t.dim() == 4 and _fast(t):
        return _fold(t, 1, 0, 0, shape[2], shape[3], want[1], want[0], (1, 1))
    if t.dim() == 4:
        big = torch.empty(want, dtype=t.dtype, device=t.device, memory_format=torch.channels_last).zero_()
        big[: shape[0], : shape[1]].copy_(t)
    else:
        big = torch.zeros(want, dtype=t.dtype, device=t.device)
        big[: shape[0]].copy_(t)
    return big


def unpad_channels(big, out) -> None:
    """The inverse of pad_channels (4-D): out's rows and channels copied out of `big`."""
    if _fast(big, out):
        return _unfold(big, 1, 0, 0, out, (1, 1))
    out.copy_(big[: out.shape[0], : out.shape[1]])


def _folded_view(nhwc, phases: tuple[int, int], channels: int):
    """The first gu * gv * channels channels of an NHWC (or KRSC) tensor viewed as [.., .., .., bu, bv, c]."""
    n, h, w, _ = nhwc.shape
    gu, gv = phases
    return nhwc[..., : gu * gv * channels].view(n, h, w, gu, gv, channels)


def _fold_views(t, block: int, pad_h: int, pad_w: int, hs: int, ws: int, c_to: int, n_to: int,
                phases: tuple[int, int]):
    """PyTorch view copies: what _fold computes (x' materialised, then its phases copied into the channels)."""
    torch = _torch()
    n, c, h, w = t.shape
    gu, gv = phases
    hb, wb = hs * block, ws * block
    xp = torch.zeros((n_to, hb, wb, c), dtype=t.dtype, device=t.device)
    rows, cols = min(h, hb - pad_h), min(w, wb - pad_w)  # the part of t that lands inside x'
    if rows > 0 and cols > 0:
        xp[:n, pad_h: pad_h + rows, pad_w: pad_w + cols].copy_(t.permute(0, 2, 3, 1)[:, :rows, :cols])
    out = torch.empty((n_to, hs, ws, c_to), dtype=t.dtype, device=t.device)
    if c_to > gu * gv * c:
        out[..., gu * gv * c:].zero_()
    src = xp.view(n_to, hs, block, ws, block, c)[:, :, :gu, :, :gv].permute(0, 1, 3, 2, 4, 5)
    _folded_view(out, phases, c).copy_(src)
    return out.permute(0, 3, 1, 2)


def _unfold_views(ts, block: int, pad_h: int, pad_w: int, out, phases: tuple[int, int]) -> None:
    """PyTorch view copies: what _unfold computes."""
    torch = _torch()
    n, c, h, w = out.shape
    gu, gv = phases
    hs, ws = ts.shape[2], ts.shape[3]
    hb, wb = hs * block, ws * block
    xp = torch.zeros((n, hs, block, ws, block, c), dtype=out.dtype, device=out.device)
    xp[:, :, :gu, :, :gv] = _folded_view(ts.permute(0, 2, 3, 1)[:n], phases, c).permute(0, 1, 3, 2, 4, 5)
    folded = xp.view(n, hb, wb, c)
    rows, cols = min(h, hb - pad_h), min(w, wb - pad_w)
    o = out.permute(0, 2, 3, 1)
    if rows < h or cols < w:
        o.zero_()
    if rows > 0 and cols > 0:
        o[:, :rows, :cols].copy_(folded[:, pad_h: pad_h + rows, pad_w: pad_w + cols])


def s2d_image(x, block: int, pad_h: int, pad_w: int, hs: int, ws: int, c_to: int, phases: tuple[int, int]):
    """x (N x C x H x W) folded into xs (N x c_to x hs x ws): xs's first gu * gv * C channels as in the module
    docstring (phases = (gu, gv)), the others zero. Rows and columns of x' past hs * block, ws * block are never
    read by the conv and are dropped."""
    fold = _fold if _fast(x) else _fold_views
    return fold(x, block, pad_h, pad_w, hs, ws, c_to, x.shape[0], phases)


def d2s_image(xs, block: int, pad_h: int, pad_w: int, out, phases: tuple[int, int]) -> None:
    """The inverse of s2d_image, into `out` (N x C x H x W): out[n, c, h, w] = xs at x' pixel (h + pad_h,
    w + pad_w); pixels of x that the fold does not reach (the conv never reads them) get zero."""
    unfold = _unfold if _fast(xs, out) else _unfold_views
    unfold(xs, block, pad_h, pad_w, out, phases)


def s2d_filter(w, block: int, c_to: int, k_to: int):
    """w (K x C x R x S) folded into ws (k_to x c_to x ceil(R / block) x ceil(S / block)) as in the module
    docstring; channels, filters and taps past w's are zero."""
    k, c, r, s = w.shape
    fold = _fold if _fast(w) else _fold_views
    return fold(w, block, 0, 0, -(-r // block), -(-s // block), c_to, k_to, fold_phases(r, s, block))


def d2s_filter(ws, block: int, out) -> None:
    """The inverse of s2d_filter, into `out` (K x C x R x S)."""
    k, c, r, s = out.shape
    unfold = _unfold if _fast(ws, out) else _unfold_views
    unfold(ws, block, 0, 0, out, fold_phases(r, s, block))
