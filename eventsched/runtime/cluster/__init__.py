"""Several machines: the Ray head side and the per-node actor."""
