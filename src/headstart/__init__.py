"""headstart: an inference server for hybrid linear-attention LLMs (Qwen3.5 family)."""

__version__ = "0.1.0"
