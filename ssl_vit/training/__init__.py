"""Lightning plumbing every training run shares: atomic step
checkpoints and exact resume, pre-emption signals and progress lines."""
