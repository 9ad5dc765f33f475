"""Launching a run's topology: every component as its own process (locally), from one config."""
