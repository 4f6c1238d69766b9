"""Benchmarks behind `hicache bench ...`: each module has add_arguments(parser) and run(args) -> int."""
