"""Number formats, bit packing and kernels (torch references and Triton twins)."""
