"""The only code that writes into a pipeline: the hotswap template and its compile (template), in-place swaps into
a slot (slot), which slot a request's adapters go to (plan), per-row LoRA for mixed batches (batched), and compile
artifacts that travel (compile_cache)."""
