"""The reference models: CNNs, recurrent and transformer models, and users' own MODULE:FUNCTION
builders.
"""
