"""Pure torch helpers that the strategies and callbacks wrap."""
