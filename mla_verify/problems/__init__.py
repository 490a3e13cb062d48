"""What a decode problem is and what its answer is: the canonical problem and its validation, the layouts
kernels read it in, building a problem from its spec (bit-identically, from a seed), the pure-PyTorch
reference, the metamorphic transforms of a problem, and the envelope of problems a kernel claims to take.

May import: core. (tests/test_imports.py holds this rule.)
"""
