"""Problem schemas, dataset loaders, prompt mixture, replay buffer and filters."""
