"""`make tune`: search a setting's final mechanism with Optuna, every trial benched on the tune split and verified."""
