"""Examples that run from the repository root (``examples.policies.<name>``)."""
