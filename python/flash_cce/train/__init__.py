"""The training application: data, objectives (losses over the stack's
statistics), references, the trainer, run directories and checkpoints, the
`flash-cce` command line and the demo. Needs the `train` extra.
"""
