"""``reshard fuzz``: the valid seeds and shared mutations (corpus), the hostile cases
(cases), the runner that loads them (runner).
"""
