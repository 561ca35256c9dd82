"""Benchmarks: python -m flashguard.bench.kv"""
