"""The suite's own test kernels: the mutants (one deliberately faulty kernel per bug class, dense and sparse)
and the CPU stand-ins with FlashMLA's calling conventions (dense, sparse).

May import: core, problems, backends. (tests/test_imports.py holds this rule.)
"""
