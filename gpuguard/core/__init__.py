"""The pure core: decisions and nouns, no I/O."""
