"""Measurements: swap strategies side by side (strategies, swaps), load tests in-process and over Ray Serve (load,
serve_load), and the GPU run (gpu_bench.sh). The engine never imports this package."""
