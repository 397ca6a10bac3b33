"""v4engine.contract: what every other part depends on and what depends on nothing above it (docs/architecture.md
§6): the model config, the cache layout, the engine format, the drafting methods' graph contracts, the backend
registry and each backend's options, call kinds, profiles and buckets, the pipeline-stage plan, the readers of
untrusted files and staged outputs. It imports no other part of v4engine (tests/test_layering.py)."""
