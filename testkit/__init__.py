"""v4engine.testkit: test support, not product code: the transformers oracle, the held-out corpus split, the GPU
check's inputs and verdicts, engine comparisons. Tests, benchmarks and examples import it; no product part does
(tests/test_layering.py)."""
