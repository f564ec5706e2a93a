"""What ``ssl-vit fit`` runs around the pretext modules: the Lightning CLI of recipes, atomic step
checkpoints and exact resume, pre-emption signals, gradient clipping and optimiser state under
sharding, and the ``evaluate`` section of a recipe."""
