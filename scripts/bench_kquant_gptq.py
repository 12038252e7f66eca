"""Time of GPTQ on the GGML k-quant grid against the importance-weighted RTN it replaced and INT4 GPTQ.

One seeded random weight ``[2, 1536, 2048]`` (two Qwen3-30B-A3B gate_up matrices) and a Hessian ``XᵀX`` of 4,096
correlated random inputs per matrix; for q4_k, q3_k and q2_k the seconds of ``QuantScheme.quantize`` with the
Hessian diagonal as importance and of ``gptq_quantize``, and of INT4 (group 32) GPTQ, all in one run on one thread
after a warm-up, with the output error ``‖(W - Q) Xᵀ‖`` of each.

Run: python scripts/bench_kquant_gptq.py
"""

from __future__ import annotations

import time

import torch

from moecompress.quantization.gptq import gptq_quantize, hessian_importance
from moecompress.quantization.scheme import QuantScheme


def _seconds(work, *args, **kwargs) -> tuple[float, object]:
    start = time.perf_counter()
    result = work(*args, **kwargs)
    return time.perf_counter() - start, result


def main() -> None:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(2, 1536, 2048, generator=generator)
    latent = torch.randn(2, 4096, 64, generator=generator)
    inputs = latent @ torch.randn(64, 2048, generator=generator) + 0.3 * torch.randn(2, 4096, 2048, generator=generator)
    hessian = inputs.transpose(1, 2) @ inputs
    importance = hessian_importance(hessian)

    def error(q) -> float:
        return float(torch.linalg.vector_norm(inputs @ (q.dequantize() - weight).transpose(1, 2)))

    gptq_quantize(weight[..., :256], hessian[:, :256, :256], QuantScheme("q4_k", 256))
    int4_seconds, int4 = _seconds(gptq_quantize, weight, hessian, QuantScheme("int4"))
    print("| scheme | importance-weighted RTN s | GPTQ s | GPTQ / RTN | GPTQ / int4 GPTQ | output error RTN | GPTQ |")
    print("|---|---|---|---|---|---|---|")
    for name in ("q4_k", "q3_k", "q2_k"):
        scheme = QuantScheme(name, 256)
        rtn_seconds, rtn = _seconds(scheme.quantize, weight, importance=importance)
        gptq_seconds, gptq = _seconds(gptq_quantize, weight, hessian, scheme)
        print(
            f"| {name} | {rtn_seconds:.2f} | {gptq_seconds:.2f} | {gptq_seconds / rtn_seconds:.1f} | "
            f"{gptq_seconds / int4_seconds:.2f} | {error(rtn):.4g} | {error(gptq):.4g} |"
        )
    print(f"int4 (group 32) GPTQ: {int4_seconds:.2f} s, output error {error(int4):.4g}")


if __name__ == "__main__":
    main()
