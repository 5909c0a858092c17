"""Training the embedded default model (a small Qwen3.5-architecture code model) and its drafter."""
