"""Measurements, one module per command: swap strategies side by side (`bench`, with `strategies`), load tests
in-process (`loadtest`; many adapters under Zipf-skewed traffic: `skewtest`, with `skewed` and `lora_zoo`) and over Ray
Serve (`servebench`), start-up times (`startbench`), the GPU check of the engine on mini SDXL and Flux pipelines
(`gpu_check`, with `mini_pipelines`) and the GPU run (gpu_bench.sh). The engine never imports this package."""
