"""DeepSeek-V4's chat format: messages -> prompt (encoding.py), answer -> message (parsing.py). Imports nothing
above the contract."""
