"""Multi-level checkpoints: the node-local tier in front of the durable checkpoint path, composed
around the plain save and load through fixed hooks (``local_tier``), and the drain that copies
a committed local checkpoint to durable storage (``drain``)."""
