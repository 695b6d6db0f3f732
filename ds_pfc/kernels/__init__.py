"""Optional fused GPU kernels (Triton); submodules import triton, this package does not.

May import: ds_pfc._checks; triton (in the kernel submodules; the core loads them lazily).
Never: ds_pfc.core and any layer above it, the root package."""
