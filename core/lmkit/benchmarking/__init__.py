"""Benchmarks: offline throughput and latency, side by side with a peer engine."""
