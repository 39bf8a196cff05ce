"""The compile layer (every torch.compile'd function goes through compile.py), the FP8 matmul primitives and the
FP8 training kernels."""
