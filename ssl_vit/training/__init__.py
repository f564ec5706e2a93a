"""Lightning plumbing every training run shares: atomic step checkpoints and exact resume,
stop requests between steps, and progress lines."""
