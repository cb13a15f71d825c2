"""Time every kind of linear map cbgen can run on all of a model's layer maps, per step.

``python bench/linear_kernels.py --rows 1,64,256 --threads 2 [--model shape:llama3.2-1b]``

For each kind (float32 / bfloat16 ``F.linear``, oneDNN prepacked float32 / bfloat16,
cbgen's few-row bfloat16 kernel (``bf16-rows``, up to 8 rows), plain bfloat16 weights
widened to float32 a chunk at a time for torch's float32 GEMM (``bf16-widened``, what
``bf16-packed`` runs where oneDNN packs no bfloat16 and cbgen's lanes kernel is not built;
``bf16-packed`` is whatever bf16 maps run here, ``bf16-onednn`` oneDNN's packed bfloat16 and
``bf16-fma`` cbgen's float32-FMA kernel whatever ``bf16_gemm_choice`` picks),
weight-only int8 (with
cbgen's few-row kernel, and ``int8-torch``: torch's kernel at every row count), 4-bit
(cbgen's bfloat16 kernel, and ``int4-torch``: torch's) and 4-bit with int8 activations
(``w4a8``); ``int4-g64``, ``int4-g128``: 4-bit in larger groups) it builds the model's layer maps with q/k/v and
gate/up fused as the fast decoder runs them, one set of distinct weights per layer
(so one row reads its weights from memory, as a real decode step does, instead of
from a cache a repeated small matrix would stay in), plus the LM head, and reports
the median time of one pass over all of them, with the weight bytes each pass reads
and the bandwidth that makes. Activations are each kind's input dtype (bfloat16 for
the quantized kinds).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig

from cbgen.bench.workloads import resolve_model
from cbgen.executor.cpu.kernels import decode_kernel
from cbgen.executor.cpu.prepack import PackedMap, pack_weight, packed_linear, widened_linear
from cbgen.executor.cpu.quantization import Int4Map, QuantizedLinear

Kernel = Callable[[torch.Tensor], torch.Tensor]


def layer_shapes(config: object) -> tuple[int, list[tuple[int, int]], tuple[int, int]]:
    """(layers, the fused per-layer shapes [out, in], the LM head's shape)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = hidden // heads
    per_layer = [
        ((heads + 2 * kv) * head_dim, hidden),  # q/k/v
        (hidden, heads * head_dim),  # o
        (2 * inter, hidden),  # gate/up
        (hidden, inter),  # down
    ]
    return config.num_hidden_layers, per_layer, (config.vocab_size, hidden)


def build(kind: str, weight: torch.Tensor, rows: int) -> tuple[Kernel, int, torch.dtype]:
    """A kernel for ``weight`` in ``kind``, the bytes it reads, its input dtype."""
    if kind in ("fp32", "bf16"):
        dtype = torch.float32 if kind == "fp32" else torch.bfloat16
        w = weight.to(dtype)
        return (lambda x: F.linear(x, w)), w.numel() * w.element_size(), dtype
    if kind == "bf16-rows":  # cbgen's AVX512-BF16 or AVX2 kernel, up to 8 rows, plain weights
        w = weight.to(torch.bfloat16).contiguous()
        native = decode_kernel()
        assert native is not None and rows <= 8, "bf16-rows: native kernels, at most 8 rows"
        return (lambda x: native.bf16_rows_matmul(x, w)), w.numel() * 2, torch.bfloat16
    if kind == "bf16-fma":  # cbgen's float32-FMA kernel (AVX-512), any rows, plain weights
        w = weight.to(torch.bfloat16).contiguous()
        native = decode_kernel()
        assert native is not None and native.bf16_fma_available(), "bf16-fma: AVX-512 builds"
        return (lambda x: native.bf16_fma_matmul(x, w)), w.numel() * 2, torch.bfloat16
    if kind == "bf16-onednn":  # oneDNN's packed bf16, whichever kernel bf16-packed picks
        packed_weight = pack_weight(weight.to(torch.bfloat16), rows)
        return (
            (lambda x: packed_linear(x, packed_weight)),
            weight.numel() * 2,
            torch.bfloat16,
        )
    if kind == "bf16-widened":
        w = weight.to(torch.bfloat16).contiguous()
        return (lambda x: widened_linear(x, w, None)), w.numel() * 2, torch.bfloat16
    if kind in ("fp32-packed", "bf16-packed"):  # bf16: plain weights where oneDNN has none
        dtype = torch.float32 if kind == "fp32-packed" else torch.bfloat16
        packed = PackedMap(weight.to(dtype), None, rows)
        return packed, weight.numel() * torch.empty((), dtype=dtype).element_size(), dtype
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = weight
    mode, _, group = kind.removesuffix("-torch").partition("-g")  # int4-g128: groups of 128
    module = QuantizedLinear.from_linear(linear, mode, int(group or 32))
    linear_map = module.kernel()
    if kind == "int8-torch":  # torch's own int8 kernel at every row count
        linear_map.rows_limit = 0
    if kind == "int4-torch":  # torch's own 4-bit kernel instead of cbgen's
        linear_map = Int4Map(
            *module.unpacked(),
            module.group_size,
            None,
            use_native_kernels=False,
        )
    tensors = [t for t in vars(linear_map).values() if isinstance(t, torch.Tensor)]
    return linear_map, sum(t.numel() * t.element_size() for t in tensors), torch.bfloat16


def measure(kind: str, config: object, rows: int, repeats: int) -> dict[str, float]:
    layers, shapes, head = layer_shapes(config)
    generator = torch.Generator().manual_seed(0)
    kernels: list[tuple[Kernel, torch.Tensor]] = []
    total_bytes = 0
    for out_features, in_features in [s for _ in range(layers) for s in shapes] + [head]:
        weight = torch.randn(out_features, in_features, generator=generator) * 0.02
        kernel, nbytes, dtype = build(kind, weight, rows)
        kernels.append((kernel, torch.randn(rows, in_features, generator=generator).to(dtype)))
        total_bytes += nbytes
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 2):
            start = time.perf_counter()
            for kernel, x in kernels:
                kernel(x)
            times.append(time.perf_counter() - start)
    median = statistics.median(times[2:])
    return {"ms": median * 1e3, "mb": total_bytes / 1e6, "gbs": total_bytes / median / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,64,256")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--kinds",
        default="fp32,fp32-packed,bf16,bf16-packed,int8,int4,w4a8",
        help="comma-separated",
    )
    parser.add_argument("--model", default="smollm2", help="bundled name, folder or shape:NAME")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = resolve_model(args.model)[0]
    config = AutoConfig.from_pretrained(folder)
    print("| kind | rows | ms per step (all maps + LM head) | MB read | GB/s | tok/s ceiling |")
    print("|---|---:|---:|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        for kind in args.kinds.split(","):
            if kind == "bf16-rows" and rows > 8:
                continue  # the row kernel takes 1 to 8 rows
            r = measure(kind, config, rows, args.repeats)
            print(
                f"| {kind} | {rows} | {r['ms']:.1f} | {r['mb']:.0f} | {r['gbs']:.1f} | "
                f"{rows / r['ms'] * 1e3:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
