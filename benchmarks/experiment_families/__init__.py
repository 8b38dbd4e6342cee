"""The experiments of benchmarks/experiments.py (its docstring says how to run each), one
module per family."""
