"""The only code that writes into a pipeline: the hotswap template and its compile (template), in-place swaps into
a slot (slot), which slot a request's adapters go to (plan), what the device holds (residency), per-row LoRA for
mixed batches (batched, with rows, groups and merged, and traced for compiled graphs), one-adapter calls merged into
the weights (fusion), the compile lifecycle (compiling), compile artifacts that travel (compile_cache) and
AOTInductor packages (aot)."""
