"""v4engine.builder: reads DeepSeek-V4 checkpoints, owns the export model, compiles engines."""
