"""The model stack for training: an mlx-lm model's decoder run layer by layer,
with a prompt encoded once for its responses (`prefix`), checkpointed layer
segments (`segmented`) or compiled layers (`compiled`), the blocked training
attention (`attention`) and the flash head, turned into the log-probability
statistics that the objectives are losses of (`stats` for pairs, `groups` for
a prompt's G completions, driven by the `plan` of each shape). Needs the `train` extra (mlx-lm). The names below load on
first use (see `flash_cce`).
"""

from .._lazy import attributes

_API = {
    "Example": "batch",
    "Group": "batch",
    "Pair": "batch",
    "Plan": "plan",
    "Scoring": "plan",
    "StackConfig": "plan",
    "check_groups": "groups",
    "check_pairs": "stats",
    "group_logprobs": "groups",
    "group_value_and_grad": "groups",
    "statistics": "stats",
    "value_and_grad": "stats",
}
__all__ = list(_API)
__getattr__, __dir__ = attributes(__name__, _API)
