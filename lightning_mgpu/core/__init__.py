"""What several features share; imports no feature room.

The compat door to private library names, option validation, devices and hosts, rank gathers, sync-BN, a step's
pieces and timing, the model's repeated blocks, training events.
"""
