"""Measurements: swap strategies side by side (strategies, swaps), load tests in-process and over Ray Serve (load,
serve_load), the GPU check of the engine on mini SDXL and Flux pipelines (gpu_check, mini_pipelines) and the GPU run
(gpu_bench.sh). The engine never imports this package."""
