"""SGLang's caches (0.5.20 and 0.5.23): RadixCache, HiRadixCache, UnifiedRadixCache on the
Python and Rust cores, with HiCache and storage, (FULL, SWA) and (FULL, MAMBA); its event
stream. Each runs from its own venv (make sglang-env, make sglang23-env)."""
