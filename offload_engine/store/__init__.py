"""Weight tiers: device, host RAM, and the checkpoint files themselves."""
