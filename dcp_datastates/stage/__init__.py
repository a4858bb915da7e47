"""Staging: a state dict -> this rank's plan of data files (``pipeline.plan_stage``), which the
writer submits to the engine. ``pipeline``: the plan, its files and the plan cache; ``items``: the
items of a state dict; ``ownership``: which rank writes a replicated value."""
