"""ABCs that plugins subclass: platform, attention, quant, weight format, model, parsers."""
