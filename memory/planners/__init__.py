"""Planners: the greedy walk (auto), the chain and Rotor's dynamic programming, the frontier, the
MILP (optimal), and make_plan, which dispatches a spec to them.
"""
