"""Per-op variants chosen with the plan: attention's form, the BPTT schedule, convolution
workspaces.
"""
