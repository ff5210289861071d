"""The loops each role runs, composed from peer.model, peer.tasks and peer.grpo."""
