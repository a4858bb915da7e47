"""Integrations with training frameworks.

- ``dcp_datastates.integrations.torchtitan``: ``DataStatesCheckpointManager``, a TorchTitan
  checkpoint manager that saves and loads with DataStates (lazy asynchronous checkpointing).

Each integration imports its framework lazily: importing the module never fails when the
framework is absent; using the class then raises an ``ImportError`` that says what to install.
"""
