"""The model stack for training: an mlx-lm model's decoder run layer by layer,
with the prompt encoded once for both responses (`prefix`), checkpointed layer
segments (`segmented`) or compiled layers (`compiled`), the blocked training
attention (`attention`) and the flash head, turned into the log-probability
statistics that the objectives are losses of. Needs the `train` extra (mlx-lm).
"""
