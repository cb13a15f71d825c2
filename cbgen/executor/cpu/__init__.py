"""CPU execution: prepacked oneDNN linears, quantized maps, the fast decoder, native kernels, OpenMP."""
