"""Save and load plans and their coordination across ranks: the pure planner,
the save and load coordination, the stored plan, the dry run.
"""
