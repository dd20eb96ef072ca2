"""From a network to a running plan: lowering to a memory program, the engine's compile cache, the
executor, deferred results.
"""
