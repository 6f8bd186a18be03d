"""Building blocks model plugins assemble: linear layers, norms, rotary, attention, MLP."""
