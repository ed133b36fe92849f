"""crowdchat's own compiled kernels: the C++ sources (`csrc/`) and their Python bindings
(`cpu_kernels`), built once per machine; CUDA's paged attention in Triton
(`triton_attention`)."""
