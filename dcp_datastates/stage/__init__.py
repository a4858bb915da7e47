"""Staging: a state dict -> this rank's plan of data files (``pipeline.plan_stage``), which the
writer submits to the engine. ``items``: the items; ``ownership``: who writes replicated values;
``files``: one planned file and its item locations; ``plan_cache``: plans cached per structure."""
