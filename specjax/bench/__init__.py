"""Benchmarks behind ``specjax bench``; each writes JSON and a plot."""
