"""flashinfer-bench: its definitions read as envelopes and layouts of a problem, its solutions as backends (built
by its own builder, called as its evaluator calls them), a failing case as one of its workloads, its evaluator's
verdict on it, and the suite's Contract-1 kernels as its solutions (docs/flashinfer-bench.md). An adapter, not a
pipeline: its cases run through run/ like any backend's. flashinfer-bench itself is imported only when used
(the ``fib`` extra).

May import: core, problems, backends. (tests/test_imports.py holds this rule.)
"""
