"""Benchmark support for weightsync: realistic checkpoint series and the baselines we compare against."""
