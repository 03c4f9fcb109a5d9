"""The CPU's own kernels: the C sources (csrc/), their build and loader, and the layers that
call them (packed linears, GGUF quantized linears, decoder layers fused in one C call)."""
