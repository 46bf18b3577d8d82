"""The ``python -m lightning_mgpu`` commands' implementations: ``env`` (:mod:`lightning_mgpu.commands.env`)."""
