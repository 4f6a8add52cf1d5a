"""Pieces the commands share: the default model's preparation and random checkpoints."""
