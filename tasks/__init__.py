"""Pipeline stages: the only place stages touch files, checkpoints and tracking. One module per stage."""
