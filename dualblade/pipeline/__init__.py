"""What goes where: the pipeline config, the budget and Algorithm 1, the LBA map and Algorithm 2.

Planning code here is pure (no I/O but reading memory limits) and is unit-tested without storage.
"""
