"""vLLM's KV cache manager (0.33.0, 0.34.0): the device cache, the CPU offloading
connector, and the hybrid coordinator with sliding-window and Mamba groups, each driven
request by request. Runs from its own venv (make vllm-env)."""
