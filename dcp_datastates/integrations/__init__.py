"""Integrations with training frameworks.

- ``dcp_datastates.integrations.torchtitan``: ``DataStatesCheckpointManager``, a TorchTitan
  checkpoint manager that saves and loads with DataStates (lazy asynchronous checkpointing).
- ``dcp_datastates.integrations.megatron``: save and load strategies of Megatron-core's
  ``dist_checkpointing``, registered as the ``datastates`` backend.
- ``dcp_datastates.integrations.deepspeed``: a DeepSpeed checkpoint engine chosen by a
  ``datastates_ckpt`` config section (``initialize``, a drop-in for ``deepspeed.initialize``),
  and the conversion of a tag to DeepSpeed's own files (``to_deepspeed``).

Each integration imports its framework lazily: importing the module never fails when the
framework is absent; using the class then raises an ``ImportError`` that says what to install.
"""
