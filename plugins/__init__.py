"""v4engine.plugins: the custom ops of DeepSeek-V4, one module each (schema + PyTorch reference)."""
