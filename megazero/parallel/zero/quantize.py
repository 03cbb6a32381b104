"""Block-wise int8 quantization for ZeRO++'s communication (qwZ weights, qgZ gradients).

A tensor is quantized row by row; each row is cut into blocks of ``block`` elements (the last one
may be shorter) and every block gets one fp32 scale, symmetric around zero::

    scale = max |x| over the block / 127        q = round(x / scale) in [-127, 127] (int8)
    dequantized x' = q * scale                  |x - x'| <= scale / 2 for every element

Worked example, one row, block 4: x = [0.5, -1.0, 0.25, 0.0 | 2.0, 1.0]
    scales = [1/127, 2/127]     q = [64, -127, 32, 0 | 127, 64]     x' = [0.504, -1.0, 0.252, 0 | 2.0, 1.008]

On the wire a row travels as one uint8 buffer: its ``C`` int8 values then its scales' bytes
(:func:`pack_rows` / :func:`unpack_rows`), so one collective carries both: C + 4 * ceil(C / block)
bytes per row instead of C * element_size.

The default block, 4096 elements, follows DeepSpeed's weight quantizer, which picks groups of at
most 8000 elements and names ~4k the best size; it is ``--zero-quantization-block-size``.
"""
from __future__ import annotations

import torch

DEFAULT_BLOCK = 4096
QMAX = 127


def num_blocks(columns: int, block: int) -> int:
    return -(-columns // block)


def packed_columns(columns: int, block: int) -> int:
    """Bytes of one packed row of ``columns`` elements: the int8 values and the fp32 scales."""
    return columns + 4 * num_blocks(columns, block)


def quantize_rows(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values [R, C] and fp32 scales [R, ceil(C / block)] of a 2-D tensor ``x`` [R, C]."""
    rows, cols = x.shape
    nb = num_blocks(cols, block)
    padded = torch.zeros(rows, nb * block, dtype=torch.float32, device=x.device)
    padded[:, :cols] = x
    blocks = padded.view(rows, nb, block)
    scales = blocks.abs().amax(dim=2) / QMAX
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))        # an all-zero block stays zero
    q = torch.round(blocks / safe.unsqueeze(2)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.view(rows, nb * block)[:, :cols].contiguous(), scales


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, block: int, dtype=torch.float32) -> torch.Tensor:
    """The values [R, C] that int8 ``q`` [R, C] with ``scales`` [R, nb] stand for, in ``dtype``."""
    rows, cols = q.shape
    nb = scales.shape[1]
    padded = torch.zeros(rows, nb * block, dtype=torch.float32, device=q.device)
    padded[:, :cols] = q
    out = (padded.view(rows, nb, block) * scales.unsqueeze(2)).view(rows, nb * block)[:, :cols]
    return out.to(dtype).contiguous()


def pack_rows(x: torch.Tensor, block: int) -> torch.Tensor:
    """Quantize ``x`` [R, C] into one uint8 tensor [R, packed_columns(C, block)] to send."""
    q, scales = quantize_rows(x, block)
    return torch.cat([q.view(torch.uint8), scales.contiguous().view(torch.uint8)], dim=1)


def unpack_rows(packed: torch.Tensor, columns: int, block: int, dtype=torch.float32) -> torch.Tensor:
    """The dequantized values [R, columns] of rows packed by :func:`pack_rows`."""
    q = packed[:, :columns].contiguous().view(torch.int8)
    scales = packed[:, columns:].contiguous().view(torch.float32)
    return dequantize_rows(q, scales, block, dtype)


def quantize_dequantize(x: torch.Tensor, block: int) -> torch.Tensor:
    """What ``x`` (1-D) becomes after a trip through the quantizer, blocks starting at element 0."""
    return unpack_rows(pack_rows(x.reshape(1, -1), block), x.numel(), block, x.dtype).reshape(x.shape)
