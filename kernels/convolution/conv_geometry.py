"""Convolution geometry, algorithm choice and workspace layout: output sizes, image blocks,
gradient parts, and how the workspace is cut into per-thread rows and gradient partials.

A :class:`ConvConfig` holds the choices that decide the bits of a result (the algorithm, the
cap on the column matrix that sets the images per product and the rows per band, the number
of gradient parts); the workspace rows (threads) never change them. :func:`conv_config`
picks the default, or under a workspace cap (``max_workspace``, vDNN's memory-optimal
algorithms) the fastest configuration whose workspace fits it. :func:`host_call` makes a
call's :class:`~.conv_call.HostCall` (its record and workspace cutting live in
:mod:`.conv_call`; their names stay importable from here).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..parallel import chunks, num_threads, split
from . import winograd, winograd4
from .conv_call import HostCall, _aligned

Pair = tuple[int, int]


# ----------------------------------------------------------------------------- geometry
def conv_output_hw(hw: Pair, kernel: Pair, stride: Pair, padding: Pair, dilation: Pair) -> Pair:
    """Output height and width (PyTorch's formula, floor mode)."""
    return tuple(  # type: ignore[return-value]
        (hw[a] + 2 * padding[a] - dilation[a] * (kernel[a] - 1) - 1) // stride[a] + 1
        for a in range(2)
    )


# When Winograd F(2x2, 3x3) pays, measured (forward + backward time, Winograd / im2col, with
# products of at least WINOGRAD_MIN_COLS columns): batch 32, 0.5-0.8 from 8x8 to 56x56 planes
# with 16 to 128 channels, 1.5 with 8 input channels; batch 128 / 64 (session 9, AMD EPYC):
# 0.58 / 0.74 at 256 channels on 8x8 planes, 0.67 / 0.75 at 512 channels on 4x4 planes,
# 1.0 on 2x2 planes (one tile).
#: Smallest number of input channels for Winograd ...
WINOGRAD_MIN_CIN = 16
#: ... and of 2x2 tiles per output plane (one: a 2x2 plane is one tile, 16 products where
#: im2col makes 36; a 1x1 plane stays with im2col, 9 against 16) ...
WINOGRAD_MIN_TILES = 1
#: ... largest ``Cin * Cout``: each thread keeps the transformed filters (16 * Cin * Cout
#: values) and, in backward, each gradient part its transformed weight-gradient partial (at
#: 512 x 512 channels, 16 MB each; im2col's banded path needs a few MB; a workspace cap
#: chooses im2col where they do not fit) ...
WINOGRAD_MAX_WEIGHTS = 512 * 512
#: ... and largest transformed image (bytes; one image is the smallest unit of work, so
#: this bounds the workspace per thread: 64 channels at 56x56 would need 9.6 MB).
WINOGRAD_MAX_IMAGE_BYTES = 8 << 20
#: Images are transformed together until the 16 products have at least this many columns
#: (tiles), even past :data:`~minidl.kernels.convolution.winograd.L2_BUDGET`, but never so many that
#: the batch makes fewer than :data:`GRAD_PARTS` blocks. Thin products were what made
#: Winograd lose on small planes: at 256 channels on 8x8 planes (16 tiles per image, one
#: image per block), the weight-gradient products ``dU += DY V^T`` were rank-16 updates of
#: a 256 x 256 matrix, 2.6x slower backward than with 256 columns (measured at 64, 128,
#: 256, 512 and 1024 columns: 256 the fastest or within noise of it on every shape tried).
#: Only where the transformed weights (16 or 36 planes of ``Cin x Cout``) overflow the L2
#: budget: below, the updates stay in cache and wider blocks only spill the tiles
#: (smallcnn's 32 x 64 channels on 14x14 planes: 1.2x slower at 6 images than at 2).
WINOGRAD_MIN_COLS = 256
#: F(4x4, 3x3) replaces F(2x2, 3x3) on output planes at least this many pixels a side.
#: Forward + backward against F(2x2, 3x3), measured (session 9, AMD EPYC, batch 128 unless
#: said): 0.72 at 256 channels on 8x8 planes, 0.70 at 128 on 16x16 (batch 64), 0.86 at 512
#: on 4x4 (1.04 at batch 64), 0.96 at 16 channels on 32x32; 2.0 on 2x2 planes (one 4x4 tile
#: of which a quarter is used). Rounding: float32 outputs within ~1.5e-5 of the largest
#: output's magnitude (F(2x2, 3x3): ~8e-7; im2col: ~1e-7).
WINOGRAD4_MIN_SIDE = 3
#: ... with at least this many ``Cin * Cout``: below it the products are cheap and the
#: transforms dominate, where F(2x2)'s (vectorised over tiles) beat F(4x4)'s (per tile):
#: inside training steps, F(4x4) / F(2x2) measured 1.1-1.2 at 64 x 64 channels on 32x32
#: planes and 32 x 64 on 14x14, 0.98 over resnet56's 16- to 64-channel layers, 0.74
#: (backward) at 64 x 128 on 16x16 and 0.65 from 128 x 256 up.
WINOGRAD4_MIN_WEIGHTS = 64 * 128


def choose_algo(x_shape: tuple[int, ...], kernel: Pair, stride: Pair, dilation: Pair,
                groups: int, padding: Pair = (1, 1), cout: int = 64, itemsize: int = 4) -> str:
    """For 3x3 / stride 1 / dilation 1 / one group within the bounds above: ``"winograd4"``
    (F(4x4, 3x3)) on output planes of at least :data:`WINOGRAD4_MIN_SIDE` a side with
    :data:`WINOGRAD4_MIN_WEIGHTS` channel pairs, else ``"winograd"`` (F(2x2, 3x3)); else
    ``"gemm"`` (im2col)."""
    cin = x_shape[1]
    if not (kernel == (3, 3) and stride == (1, 1) and dilation == (1, 1) and groups == 1
            and cin >= WINOGRAD_MIN_CIN and cin * cout <= WINOGRAD_MAX_WEIGHTS):
        return "gemm"
    ho, wo = x_shape[2] + 2 * padding[0] - 2, x_shape[3] + 2 * padding[1] - 2
    if min(ho, wo) >= WINOGRAD4_MIN_SIDE and cin * cout >= WINOGRAD4_MIN_WEIGHTS and \
            winograd4.transformed_image_bytes(
            cin, cout, ho, wo, itemsize) <= WINOGRAD_MAX_IMAGE_BYTES:
        return "winograd4"
    th, tw = winograd.tiles(ho, wo)
    image = winograd.transformed_image_bytes(cin, cout, ho, wo, itemsize)
    if min(ho, wo) >= 2 and th * tw >= WINOGRAD_MIN_TILES and image <= WINOGRAD_MAX_IMAGE_BYTES:
        return "winograd"
    return "gemm"


#: Under a column cap ``c`` below the default, a Winograd block's transformed tiles (input,
#: output and their gradients) stay below ``WINOGRAD_LEAN_FACTOR * c`` bytes (one image at
#: the least; ``c = 0``: one image). Under a budget this keeps Winograd for wide layers whose
#: full blocks do not fit (VGG-11 b128 at 217 MB: 256 x 256 channels on 8x8 planes with 160
#: columns instead of im2col).
WINOGRAD_LEAN_FACTOR = 8


def _winograd_lean_nb(x_shape, cout, padding, itemsize, algo: str, col_bytes: int) -> int:
    """Images per Winograd block under the column cap ``col_bytes`` (see
    :data:`WINOGRAD_LEAN_FACTOR`)."""
    if col_bytes <= 0:
        return 1
    ho, wo = x_shape[2] + 2 * padding[0] - 2, x_shape[3] + 2 * padding[1] - 2
    per_image = WINOGRAD_KERNELS[algo].transformed_image_bytes(x_shape[1], cout, ho, wo,
                                                               itemsize)
    return max(1, WINOGRAD_LEAN_FACTOR * col_bytes // per_image)


#: The Winograd kernels by algorithm name: F(2x2, 3x3) and F(4x4, 3x3).
WINOGRAD_KERNELS = {"winograd": winograd, "winograd4": winograd4}


def _winograd_nb(x_shape, cout, padding, itemsize, algo: str = "winograd") -> int:
    """Images per Winograd block: as many as fit the L2 budget, or more up to
    :data:`WINOGRAD_MIN_COLS` columns while the batch still makes :data:`GRAD_PARTS` blocks."""
    kernels = WINOGRAD_KERNELS[algo]
    n, cin = max(1, x_shape[0]), x_shape[1]
    ho, wo = x_shape[2] + 2 * padding[0] - 2, x_shape[3] + 2 * padding[1] - 2
    nb = kernels.images_per_block(cin, cout, ho, wo, itemsize)
    if kernels.PLANES * cin * cout * itemsize <= winograd.L2_BUDGET:
        return min(n, nb)  # the weight-gradient products stay in cache: no need to widen
    th, tw = kernels.tiles(ho, wo)
    wide = min(-(-WINOGRAD_MIN_COLS // (th * tw)), -(-n // GRAD_PARTS))
    return min(n, max(wide, nb))


#: The im2col path multiplies several images at once when one image's output plane has
#: fewer columns than this (small late-stage planes: a 4x4 plane alone makes a 16-column
#: product that streams the whole weight matrix for little work) ...
GEMM_MIN_COLS = 256
#: ... and cuts large planes into bands of output rows: its im2col matrix (per thread, and
#: its gradient in backward) stays below this many bytes whatever the image size.
GEMM_MAX_COL_BYTES = 4 << 20


#: Unpadded stride-1 convolutions whose output rows are shorter than the input's (LeNet-5's
#: conv2: 10 of 14): im2col copies each output row of each (channel, kernel offset) on its own,
#: ``k * ho`` copies of ``wo`` values an image. Laid out at the input's row pitch instead,
#: each of the ``k`` rows of an image's column matrix is one contiguous run of the input,
#: ``(ho-1) * w + wo`` values of which ``ho * wo`` are outputs: the products also fill the
#: ``w - wo`` columns after each output row, which no output reads. Measured (AMD EPYC, im2col
#: forward + backward, wide over plain, one process alternating): output rows of 4-10 values
#: 0.65-0.93 (LeNet-5 conv2 at b64 0.84, and 0.92 of its whole training step); rows of 24-30
#: values 0.94-1.06, even within noise; 66 % unused columns 1.03. Chosen for output rows of
#: at most :data:`WIDE_MAX_ROW` values while the unused columns stay below
#: :data:`WIDE_MAX_EXTRA` of the used ones, where one image's matrix fits the column cap.
WIDE_MAX_ROW = 16
WIDE_MAX_EXTRA = 0.5


def column_pitch(hw: Pair, kernel: Pair, stride: Pair, padding: Pair, dilation: Pair) -> int:
    """Columns per output row of the im2col matrix: the input's width where the wide layout
    (:data:`WIDE_MAX_ROW`, :data:`WIDE_MAX_EXTRA`) applies, else the output's width."""
    ho, wo = conv_output_hw(hw, kernel, stride, padding, dilation)
    w = hw[1]
    if stride == (1, 1) and padding == (0, 0) and 0 < wo <= WIDE_MAX_ROW and wo < w and \
            ho >= 1 and (ho - 1) * w + wo <= (1 + WIDE_MAX_EXTRA) * ho * wo:
        return w
    return wo


def _gemm_blocking(x_shape: tuple[int, ...], k: int, ho: int, wo: int, itemsize: int,
                   col_bytes: int = GEMM_MAX_COL_BYTES, pitch: int | None = None
                   ) -> tuple[int, int, int]:
    """``(images per product, output rows per band, columns per output row)`` of the im2col
    path, its column matrix kept below ``col_bytes`` (one output row of one image at the
    least). ``pitch`` (:func:`column_pitch`) wider than ``wo`` is taken where one image's
    matrix fits (whole images, no bands), else the plain layout."""
    if pitch is not None and pitch != wo:
        image = (ho - 1) * pitch + wo  # columns of one image in the wide layout
        if k * image * itemsize <= col_bytes:
            nb = min(-(-GEMM_MIN_COLS // image), col_bytes // (k * image * itemsize))
            return max(1, min(nb, x_shape[0])), ho, pitch
    row = max(1, k * wo * itemsize)
    band = max(1, min(ho, col_bytes // row))
    if band < ho:
        return 1, band, wo
    nb = -(-GEMM_MIN_COLS // max(ho * wo, 1))
    nb = min(nb, max(1, col_bytes // (row * ho)))
    return max(1, min(nb, x_shape[0])), ho, wo


@dataclass(frozen=True)
class Im2colBlocking:
    """How the im2col path of one convolution cuts its work: ``k`` rows of the column
    matrix, ``nb`` images per product, ``band`` output rows per band, ``pitch`` columns per
    output row (:func:`column_pitch`) and ``cols`` columns of one image (or band) in the
    matrix; ``wide`` when the pitch is wider than the output (the products then go through
    a buffer)."""

    k: int
    nb: int
    band: int
    pitch: int
    cols: int
    wide: bool


def im2col_blocking(x_shape: tuple[int, ...], kernel: Pair, stride: Pair, padding: Pair,
                    dilation: Pair, groups: int, itemsize: int,
                    col_bytes: int = GEMM_MAX_COL_BYTES) -> Im2colBlocking:
    """The :class:`Im2colBlocking` of a convolution under the column cap ``col_bytes``."""
    ho, wo = conv_output_hw(x_shape[2:], kernel, stride, padding, dilation)
    k = x_shape[1] // groups * kernel[0] * kernel[1]
    pitch = column_pitch(x_shape[2:], kernel, stride, padding, dilation)
    nb, band, pitch = _gemm_blocking(x_shape, k, ho, wo, itemsize, col_bytes, pitch)
    wide = pitch != wo
    cols = (ho - 1) * pitch + wo if wide else band * wo
    return Im2colBlocking(k, nb, band, pitch, cols, wide)


def _slab_elems(
    x_shape: tuple[int, ...], cout: int, kernel: Pair, stride: Pair, padding: Pair,
    dilation: Pair, groups: int, backward: bool, algo: str, itemsize: int,
    col_bytes: int = GEMM_MAX_COL_BYTES, parts: int | None = None,
) -> tuple[list[int], list[tuple[int, int]], int]:
    """Element counts of one thread's buffers (in the order the kernels take them); the
    gradient partials as ``(count, elements)`` pairs; and the images per block. ``col_bytes``
    and ``parts`` (at most, default :data:`GRAD_PARTS`) are those of a :class:`ConvConfig`."""
    if algo in WINOGRAD_KERNELS:
        kernels = WINOGRAD_KERNELS[algo]
        nb = _winograd_nb(x_shape, cout, padding, itemsize, algo)
        if col_bytes < GEMM_MAX_COL_BYTES:  # leaner: blocks of transformed tiles below a cap
            nb = min(nb, _winograd_lean_nb(x_shape, cout, padding, itemsize, algo, col_bytes))
        row = kernels.slab_elems(x_shape, cout, padding, nb, backward)
        if not backward:
            return row, [], nb
        p = grad_parts(x_shape[0], nb, parts)
        return row, [(p, cout), (p, kernels.PLANES * cout * x_shape[1])], nb  # db, dW
    blk = im2col_blocking(x_shape, kernel, stride, padding, dilation, groups, itemsize,
                          col_bytes)
    k, nb = blk.k, blk.nb
    ln = nb * blk.cols
    # products of several images side by side, or of the wide layout, go through a buffer
    side = cout // groups * ln if nb > 1 or blk.wide else 0
    if not backward:
        return [k * ln, side], [], nb  # col, y block
    p = grad_parts(x_shape[0], nb, parts)
    # col, dcol, dy block; db per part, dW per part but the first (it goes straight to dw)
    return [k * ln, k * ln, side], [(p, cout), (p - 1, cout * k)], nb


#: Weight and bias gradients are sums over the batch taken in at most this many fixed parts
#: (contiguous runs of image blocks), each accumulated into its own partial and then added in
#: part order: the parts depend on the shapes only, so the sums never depend on the number of
#: threads (threads take whole parts). Each part past the first costs one weight-sized partial
#: in the workspace; two match these 2-core machines (the same workspace as one partial per
#: extra thread had). With more cores, more parts would let more threads share the backward.
GRAD_PARTS = 2


def grad_parts(n: int, nb: int, parts: int | None = None) -> int:
    """Parts the gradient sums of an ``n``-image batch in blocks of ``nb`` are cut into (at
    most ``parts``, default :data:`GRAD_PARTS`)."""
    return max(1, min(GRAD_PARTS if parts is None else parts, -(-n // nb)))


def block_bounds(n: int, nb: int, parts: int) -> np.ndarray:
    """Image bounds (``int64``, ``parts' + 1`` entries) of up to ``parts`` contiguous runs of
    the ``nb``-image blocks of ``range(n)`` (blocks start at multiples of ``nb``)."""
    blocks = chunks(max(1, -(-n // nb)), parts)
    return np.array([0] + [min(n, stop * nb) for _, stop in blocks], np.int64)


#: Thread cap of the conv kernels: every thread has its own workspace row, so the declared
#: workspace grows with the thread count.
MAX_THREADS = 16


def _default_threads() -> int:
    return min(num_threads(), MAX_THREADS)


def _threads(layout: tuple[list[int], list[tuple[int, int]], int], n: int, backward: bool,
             threads: int | None) -> int:
    """Workspace rows wanted: one per thread, no more than there are blocks (forward) or
    gradient parts (backward) to share out."""
    _, parts, nb = layout
    units = parts[0][0] if backward else -(-max(1, n) // nb)
    return max(1, min(threads or _default_threads(), units))


def _parts_elems(parts: list[tuple[int, int]], itemsize: int) -> int:
    return sum(count * _aligned(e, itemsize) // itemsize for count, e in parts)


# ----------------------------------------------------------------------------- configurations
@dataclass(frozen=True)
class ConvConfig:
    """What decides the bits of one convolution call: the algorithm, the cap on the im2col
    matrix (``col_bytes``: images per product, output rows per band; below the default,
    Winograd transforms one image at a time) and the most gradient parts (backward: each part
    past the first costs a weight-sized partial, and one part runs on one thread)."""

    algo: str
    col_bytes: int = GEMM_MAX_COL_BYTES
    parts: int = GRAD_PARTS


#: Column-matrix caps a workspace cap may choose from (bytes), largest first; 0 is one output
#: row of one image per product (the least workspace, the smallest products).
LEAN_COL_BYTES = (GEMM_MAX_COL_BYTES, 1 << 20, 256 << 10, 64 << 10, 0)
#: Workspace rows (threads) the choice under a cap is costed for. The choice changes sums'
#: order, so it must not depend on the machine's thread count: results under one cap are
#: bit-identical for any thread count (only the rows that fit the workspace follow it).
REFERENCE_ROWS = 2
#: Time of Winograd relative to im2col where :func:`choose_algo` picks it (measured 0.5-0.8
#: for F(2x2, 3x3), 0.4-0.6 for F(4x4, 3x3)).
WINOGRAD_TIME = {"winograd": 0.65, "winograd4": 0.5}
#: Products of ``c`` columns cost ``1 + SMALL_PRODUCT_COLS / c`` times a large one's per
#: multiply-add (a one-column product streams the whole weight for a matrix-vector product).
SMALL_PRODUCT_COLS = 16


@dataclass(frozen=True)
class _Sized:
    config: ConvConfig
    layout: tuple[list[int], list[tuple[int, int]], int]
    per: int  # bytes of one workspace row
    fixed: int  # bytes of the gradient partials
    units: int  # blocks (forward) or gradient parts (backward) to share out over rows


def _sized(x_shape: tuple[int, ...], cout: int, kernel: Pair, stride: Pair, padding: Pair,
           dilation: Pair, groups: int, backward: bool, itemsize: int,
           config: ConvConfig) -> _Sized:
    layout = _slab_elems(x_shape, cout, kernel, stride, padding, dilation, groups, backward,
                         config.algo, itemsize, config.col_bytes, config.parts)
    per = sum(_aligned(e, itemsize) for e in layout[0])
    fixed = _parts_elems(layout[1], itemsize) * itemsize
    units = layout[1][0][0] if backward else -(-max(1, x_shape[0]) // layout[2])
    return _Sized(config, layout, per, fixed, units)


def _product_cols(x_shape: tuple[int, ...], kernel: Pair, stride: Pair, padding: Pair,
                  dilation: Pair, groups: int, itemsize: int, s: _Sized) -> int:
    """Columns of the products a configuration makes."""
    ho, wo = conv_output_hw(x_shape[2:], kernel, stride, padding, dilation)
    if s.config.algo in WINOGRAD_KERNELS:
        th, tw = WINOGRAD_KERNELS[s.config.algo].tiles(ho, wo)
        return s.layout[2] * th * tw
    blk = im2col_blocking(x_shape, kernel, stride, padding, dilation, groups, itemsize,
                          s.config.col_bytes)
    return blk.nb * blk.cols


def conv_config(
    x_shape: tuple[int, ...], cout: int, kernel: Pair, stride: Pair, padding: Pair,
    dilation: Pair, groups: int, itemsize: int, backward: bool,
    max_workspace: int | None = None, algo: str | None = None,
) -> ConvConfig:
    """The configuration of one call: without ``max_workspace`` the default (``algo`` or
    :func:`choose_algo`, :data:`GEMM_MAX_COL_BYTES`, :data:`GRAD_PARTS`), which no cap ever
    changes when it fits (with the rows of :data:`REFERENCE_ROWS` threads); with it, the
    configuration of least estimated time (algorithm:
    :data:`WINOGRAD_TIME`; products: :data:`SMALL_PRODUCT_COLS`; over the rows of
    :data:`REFERENCE_ROWS` threads that fit the cap) among the default algorithm and im2col,
    the column caps of :data:`LEAN_COL_BYTES` and one or :data:`GRAD_PARTS` gradient parts,
    whose workspace with one row fits ``max_workspace``; if none fits, the one of least
    workspace. A function of the shapes and the cap alone (never of the thread count)."""
    default_algo = algo or choose_algo(x_shape, kernel, stride, dilation, groups, padding,
                                       cout, itemsize)
    default = ConvConfig(default_algo)
    if max_workspace is None:
        return default
    geom = (x_shape, cout, kernel, stride, padding, dilation, groups, backward, itemsize)
    s = _sized(*geom, default)
    if min(REFERENCE_ROWS, s.units) * s.per + s.fixed <= max_workspace:
        return default  # the default fits with all its rows: a cap changes nothing
    fallback = {"winograd4": ["winograd", "gemm"], "winograd": ["gemm"]}
    algos = [default_algo] + (fallback.get(default_algo, []) if algo is None else [])
    best: tuple[float, int, ConvConfig] | None = None
    least: tuple[int, int, ConvConfig] | None = None
    order = 0
    for a in algos:
        cols = LEAN_COL_BYTES
        for col in cols:
            for parts in ((GRAD_PARTS, 1) if backward else (GRAD_PARTS,)):
                s = _sized(*geom, ConvConfig(a, col, parts))
                order += 1
                need = s.per + s.fixed
                if least is None or (need, order) < least[:2]:
                    least = (need, order, s.config)
                if need > max_workspace:
                    continue
                rows = min(REFERENCE_ROWS, s.units, (max_workspace - s.fixed) // s.per)
                pcols = _product_cols(x_shape, kernel, stride, padding, dilation, groups,
                                      itemsize, s)
                time = WINOGRAD_TIME.get(a, 1.0) * \
                    (1.0 + SMALL_PRODUCT_COLS / max(1, pcols)) / rows
                if best is None or (time, order) < best[:2]:
                    best = (time, order, s.config)
    assert least is not None
    return best[2] if best is not None else least[2]


def conv2d_workspace_bytes(
    x_shape: tuple[int, ...], cout: int, kernel: Pair, stride: Pair, padding: Pair,
    dilation: Pair, groups: int, dtype: Any, backward: bool, threads: int | None = None,
    algo: str | None = None, max_workspace: int | None = None,
) -> int:
    """Workspace bytes of :func:`conv2d_forward` / :func:`conv2d_backward` (all threads).
    With ``max_workspace``: the configuration :func:`conv_config` picks under it, with the
    rows of ``threads`` (default :data:`REFERENCE_ROWS`, whatever the machine's thread count)
    that fit, at least one (more than the cap if even the leanest does not fit)."""
    itemsize = np.dtype(dtype).itemsize
    cfg = conv_config(x_shape, cout, kernel, stride, padding, dilation, groups, itemsize,
                      backward, max_workspace, algo)
    s = _sized(x_shape, cout, kernel, stride, padding, dilation, groups, backward, itemsize,
               cfg)
    if max_workspace is None:
        t = _threads(s.layout, x_shape[0], backward, threads)
    else:  # rows for REFERENCE_ROWS threads: a capped workspace is the same on every machine
        t = max(1, min(threads or REFERENCE_ROWS, s.units, (max_workspace - s.fixed) // s.per))
    return t * s.per + s.fixed


@functools.lru_cache(maxsize=1024)
def host_call(x_shape: tuple[int, ...], cout: int, kernel: Pair, stride: Pair, padding: Pair,
              dilation: Pair, groups: int, itemsize: int, backward: bool,
              max_workspace: int | None, algo: str | None, threads: int | None,
              default_threads: int, workspace_nbytes: int | None, serial_macs: int
              ) -> HostCall:
    """The :class:`HostCall` of a call: ``threads`` as the caller forced it (``None``: up to
    ``default_threads``), ``workspace_nbytes`` the workspace given (``None``: one of
    ``nbytes`` is allocated); calls of fewer than ``serial_macs`` multiply-adds run on the
    calling thread unless ``threads`` is forced. Raises ``ValueError`` when the workspace is
    too small."""
    n = x_shape[0]
    cfg = conv_config(x_shape, cout, kernel, stride, padding, dilation, groups, itemsize,
                      backward, max_workspace, algo)
    elems, parts, nb = _slab_elems(x_shape, cout, kernel, stride, padding, dilation, groups,
                                   backward, cfg.algo, itemsize, cfg.col_bytes, cfg.parts)
    per = sum(_aligned(e, itemsize) for e in elems)
    fixed = _parts_elems(parts, itemsize) * itemsize
    t = _threads((elems, parts, nb), n, backward, threads or default_threads)
    nbytes = t * per + fixed
    if workspace_nbytes is not None:
        t = min(t, (workspace_nbytes - fixed) // per) if per else t
        if t < 1 or workspace_nbytes < fixed:
            raise ValueError(f"conv2d workspace of {workspace_nbytes} bytes, needs at least "
                             f"{per + fixed}")
    offs = np.cumsum([0] + [_aligned(e, itemsize) // itemsize for e in elems[:-1]]
                     ).astype(np.int64)
    ho, wo = conv_output_hw(x_shape[2:], kernel, stride, padding, dilation)
    blk = im2col_blocking(x_shape, kernel, stride, padding, dilation, groups, itemsize,
                          cfg.col_bytes)
    macs = n * cout * ho * wo * blk.k
    parallel = split(n, t, macs, serial_macs, force=threads is not None) is not None
    # forward: one run of blocks per thread (all of them on the calling thread if serial)
    bounds = block_bounds(n, nb, parts[0][0] if backward else (t if parallel else 1))
    return HostCall(cfg, nb, blk.band, blk.pitch, t, per // itemsize, offs,
                    tuple(parts), bounds, parallel, nbytes)
