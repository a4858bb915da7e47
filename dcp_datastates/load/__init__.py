"""The load: read each data file's wanted byte ranges through the storage, verify every piece,
hand tensors and values to DCP's planner (``read``); check a checkpoint without loading it
(``verify``)."""
