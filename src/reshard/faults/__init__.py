"""``reshard faults``: the fault-injecting storage (inject) and the fault matrix.
"""
