"""Optional fused GPU kernels (Triton); submodules import triton, this package does not."""
