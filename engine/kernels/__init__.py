"""crowdchat's own compiled kernels: the C++ sources (`csrc/`) and their Python bindings
(`cpu_kernels`), built once per machine. GPU kernels belong here too."""
