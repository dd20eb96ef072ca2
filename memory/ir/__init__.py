"""The vocabulary every pass, planner and runtime shares: programs (tensors and steps), plans
(typed actions), the memory configuration, liveness, residency, units.
"""
