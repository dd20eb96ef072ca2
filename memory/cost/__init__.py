"""The cost model: target GPUs' profiles, the step-time simulation, link emulation.
"""
