"""First-party lmkit plugins, registered through the "lmkit" entry-point group."""
