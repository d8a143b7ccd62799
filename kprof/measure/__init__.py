"""Timers, statistics and stopping, environment fingerprints. torch is imported inside functions only."""
