"""The suite's own test kernels: the mutants (one deliberately faulty kernel per bug class) and the CPU
stand-in with FlashMLA's calling convention.

May import: core, problems, backends. (tests/test_imports.py holds this rule.)
"""
