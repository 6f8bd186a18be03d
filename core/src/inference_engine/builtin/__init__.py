"""The core's own plugins, registered through the core's entry point like any other."""
