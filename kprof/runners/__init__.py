"""Kernel runners and their registry. Importing this package imports no measurement library."""
