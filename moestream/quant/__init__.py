"""moestream.quant: quantized weight formats, dequantized in vectorized torch (CPU and CUDA).

Formats (``FORMATS``; look up with ``get_format(name)``, ``gguf_format(type)`` or
``hf_quant_format(ModelConfig.quantization)``):

* GGUF, ``gguf:<TYPE>``: F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K IQ1_S IQ1_M
  IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S IQ4_NL IQ4_XS TQ1_0 TQ2_0 MXFP4 NVFP4 -- bit-identical to
  ``gguf.quants.dequantize``.
* HF: ``fp8_block`` (128x128 ``weight_scale_inv``; ``fp8_block_format((bn, bk))`` for others),
  ``fp8_channel``, ``fp8_tensor`` (ModelOpt FP8), ``nvfp4`` (ModelOpt), ``mxfp4`` (OCP / gpt-oss).

API (``raw`` = one tensor for GGUF, else a mapping of checkpoint tensor names; ``shape`` = the
logical ``(*lead, N, K)``; rows are numbered over the flattened ``prod(lead)*N`` rows)::

    fmt = gguf_format("Q4_K")                      # or get_format("nvfp4"), ...
    w   = fmt.dequantize(raw, shape, torch.bfloat16)             # whole tensor (small weights)
    r   = fmt.dequantize_rows(raw, shape, row_ids, torch.float32)  # gather rows -> (len, K)
    t   = fmt.dequantize_tile(raw, shape, slice(r0, r1), slice(c0, c1))  # c0 % fmt.col_align == 0
    for r0, r1, tile in fmt.iter_row_tiles(raw, shape, tile_rows): ...  # one dense tile at a time
    y   = qlinear(x, fmt, raw, shape, rows=(e*N, (e+1)*N))          # x @ W_e.T, tile by tile
    fmt.nbytes(shape), fmt.row_nbytes(K), fmt.bits_per_weight(K), fmt.part_specs(shape)

``QuantizedTensor(fmt, shape, raw)`` bundles the three (``.to(device)``, ``.dequantize()``,
``.linear(x)``, ``.nbytes``).  Decoding is float32 (float64 when asked for float64), then a cast.

CUDA tensors are decoded by Triton kernels (``triton_dequant``: one kernel per call, bit-identical
to the torch decoders) when triton is installed and ``MOESTREAM_TRITON`` is not ``0``; the torch
decoders are the reference and the CPU path. ``synthetic.random_raw(fmt, shape, device)`` makes
valid random weights of any format (benchmarks).
"""
from .base import (FORMATS, PartSpec, QuantFormat, QuantFormatError, QuantizedTensor, compute_dtype,
                   default_tile_rows, get_format, qlinear, register)
from .fp_formats import (FP8_BLOCK, FP8_CHANNEL, FP8_TENSOR, MXFP4, NVFP4, FP8Format, MXFP4Format,
                         NVFP4Format, e2m1_table, e4m3fn_table, fp8_block_format, hf_quant_format)
from .gguf_formats import GGML_TYPE_IDS, GGML_TYPE_NAMES, GGUF_FORMATS, GGUFFormat, gguf_format, ksigns_table

__all__ = [
    "FORMATS", "PartSpec", "QuantFormat", "QuantFormatError", "QuantizedTensor", "compute_dtype",
    "default_tile_rows", "get_format", "qlinear", "register",
    "FP8_BLOCK", "FP8_CHANNEL", "FP8_TENSOR", "MXFP4", "NVFP4", "FP8Format", "MXFP4Format", "NVFP4Format",
    "e2m1_table", "e4m3fn_table", "fp8_block_format", "hf_quant_format",
    "GGML_TYPE_IDS", "GGML_TYPE_NAMES", "GGUF_FORMATS", "GGUFFormat", "gguf_format", "ksigns_table",
]
