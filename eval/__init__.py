"""Evaluation: likelihood, downstream tasks and throughput benchmarks (JSON + PNG)."""
